"""The governance service: raw feedback in; clean records, quarantine and an audit trail out.

Per batch of raw messages:
  dedupe by record id → parse (unknown version / unparseable → `schema`) → Great Expectations
  suite (→ vocab/length/rounds/... reasons) → Presidio PII scrub of prompt and output →
  re-tokenise only the scrubbed spans, re-map rounds → flood and near-duplicate filters →
  Parquet shards + clean topic, quarantine topic → lineage + audit (one transaction) → commit
  offsets.
Outputs become durable before offsets are committed, and the lineage store knows a batch
atomically, so a crash anywhere re-delivers the batch and the dedupe turns it into a no-op for the
buffer (topic consumers dedupe by record id: delivery there is at-least-once). For every batch
in = clean + quarantined + duplicate, and it is checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from adaflash.feedback import topics
from adaflash.feedback.schema import (
    SCHEMA_VERSION,
    CleanRecord,
    FeedbackRecord,
    Provenance,
    QuarantineReason,
    QuarantineRecord,
    RoundRecord,
    SchemaError,
    parse_record,
)
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.checks import Limits, RecordValidator
from adaflash.governance.filters import FilterConfig, FloodFilter, NearDuplicateFilter, minhash
from adaflash.governance.lineage import BatchAudit, LineageStore, RecordRow, ShardRow
from adaflash.governance.pii import PiiScrubber, replaced_spans
from adaflash.governance.quarantine import audit_quarantine
from adaflash.governance.retokenize import scrub_token_ids
from adaflash.models.targets import Vocabulary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    """One consumed Kafka message (or a test's stand-in for one)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class BatchOutcome:
    clean: list[CleanRecord] = field(default_factory=list)
    quarantined: list[QuarantineRecord] = field(default_factory=list)
    rows: list[RecordRow] = field(default_factory=list)
    n_in: int = 0
    n_duplicate: int = 0
    pii: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    offsets: dict[str, list[int]] = field(default_factory=dict)
    timings: Counter = field(default_factory=Counter)  # stage -> seconds (benchmark profile)


@dataclass(frozen=True)
class GovernanceConfig:
    data_dir: Path
    bootstrap_servers: str = topics.DEFAULT_BOOTSTRAP
    group_id: str = "adaflash-governance"
    batch_size: int = 256
    poll_timeout_ms: int = 1000
    limits: Limits = Limits()
    filters: FilterConfig = FilterConfig()
    # Poison-pill caps, checked before anything parses or scrubs a payload: a bigger or deeper
    # one is quarantined unread. 512 KiB keeps every text below spaCy's 1M-character limit.
    max_payload_bytes: int = 512 * 1024
    max_json_depth: int = 32

    @property
    def buffer_dir(self) -> Path:
        return self.data_dir / "buffer"

    @property
    def lineage_path(self) -> Path:
        return self.data_dir / "lineage.sqlite"


def _tenant_path_ok(tenant: str) -> bool:
    return 0 < len(tenant) <= 64 and all(c.isalnum() or c in "-_." for c in tenant) and tenant[0] != "."


class Governor:
    """The per-batch logic, independent of Kafka (the service feeds it; tests may too)."""

    def __init__(self, cfg: GovernanceConfig, vocab: Vocabulary, scrubber: PiiScrubber | None = None) -> None:
        self.cfg = cfg
        self.vocab = vocab
        self.scrubber = scrubber or PiiScrubber()
        self.validator = RecordValidator(vocab.tokenizer, vocab.vocab_size, vocab.fingerprint, cfg.limits)
        self.lineage = LineageStore(cfg.lineage_path)
        self.buffer = ReplayBuffer(cfg.buffer_dir)
        removed = self.buffer.remove_orphans(self.lineage.shard_ids())
        if removed:
            log.warning("removed %d orphan shard(s) left by an interrupted batch", len(removed))
        self.flood = FloodFilter(cfg.filters)
        self.dups = NearDuplicateFilter(cfg.filters)
        self._rebuild_windows()

    def _rebuild_windows(self) -> None:
        latest = self.lineage.latest_event_time()
        if latest is None:
            return
        f = self.cfg.filters  # late events still count against a window: keep the lateness too
        horizon = latest - max(f.flood_window_s, f.dup_window_s) - f.max_lateness_s
        for tenant, ts, h in self.lineage.recent(horizon):
            if tenant is not None and ts >= latest - f.flood_window_s - f.max_lateness_s:
                self.flood.observe(tenant, ts)
            if h is not None:
                self.dups.observe(h, ts)

    # -- the batch ------------------------------------------------------------------------------------
    def govern(self, messages: list[Message]) -> BatchOutcome:
        out = BatchOutcome(n_in=len(messages))
        t = time.perf_counter()
        for m in messages:
            key = f"{m.topic}/{m.partition}"
            lo, hi = out.offsets.get(key, [m.offset, m.offset])
            out.offsets[key] = [min(lo, m.offset), max(hi, m.offset)]

        parsed: list[tuple[Message, FeedbackRecord]] = []
        failed: list[tuple[Message, str, str]] = []  # message, reason code, detail
        ids_in_batch: set[str] = set()
        unread: list[tuple[Message, str, str]] = []  # over a cap: quarantined without parsing
        caps = [_over_caps(m.value, self.cfg) for m in messages]
        candidate_ids = [_message_id(m, peek=cap is None) for m, cap in zip(messages, caps, strict=True)]
        known = self.lineage.known([i for i in candidate_ids if i])
        for m, rid, cap in zip(messages, candidate_ids, caps, strict=True):
            if rid and (rid in known or rid in ids_in_batch):
                out.n_duplicate += 1
                continue
            if rid:
                ids_in_batch.add(rid)
            if cap is not None:
                unread.append((m, *cap))
                continue
            try:
                parsed.append((m, parse_record(m.value)))
            except SchemaError as exc:
                failed.append((m, _schema_code(m.value), str(exc)))
        out.timings["parse"] += time.perf_counter() - t

        t = time.perf_counter()
        gx_reasons = self._check_isolated(parsed, failed)
        out.timings["validate (GX)"] += time.perf_counter() - t

        t = time.perf_counter()
        texts = [x for _, r in parsed for x in (r.prompt_text, r.output_text)]
        raw_texts = _strings_of_failed(failed)
        # Texts of one record share its surrogates (the same fake name in prompt and output).
        groups = [i // 2 for i in range(len(texts))]
        groups += [("raw", j) for j, (_, strings) in enumerate(raw_texts) for _ in strings]
        scrubbed = self._scrub_isolated(
            texts + [s for _, strings in raw_texts for s in strings], groups=groups
        )
        out.timings["PII scrub (Presidio)"] += time.perf_counter() - t

        t = time.perf_counter()
        governed_at = datetime.now(UTC)
        for i, (m, rec) in enumerate(parsed):
            sp, so = scrubbed[2 * i], scrubbed[2 * i + 1]
            if sp is None or so is None or rec.record_id in gx_reasons.get(_FAILED, ()):
                why = (
                    ("scrub_failed", "PII scrubbing raised")
                    if sp is None or so is None
                    else ("check_failed", "validation raised")
                )
                self._quarantine_unkept(out, m, rec.record_id, rec.tenant_id, *why, governed_at)
                continue
            reasons = [QuarantineReason(code=c, detail=d) for c, d in gx_reasons.get(rec.record_id, [])]
            if not _tenant_path_ok(rec.tenant_id):
                reasons.append(QuarantineReason(code="values", detail="tenant_id: 1-64 of [A-Za-z0-9._-]"))
            if sp.unsure or so.unsure:  # the second PII layer could not decide: keep no text
                doubt = "; ".join(sorted({*sp.unsure, *so.unsure}))
                reasons.append(QuarantineReason(code="pii_unsure", detail=doubt))
            ts = rec.created_at.timestamp()
            h = minhash(sp.masked)  # surrogates differ per record; placeholders do not
            if self.flood.observe(rec.tenant_id, ts, rec.record_id):
                reasons.append(
                    QuarantineReason(
                        code="flood",
                        detail=f"> {self.cfg.filters.flood_max_per_window} "
                        f"requests per {self.cfg.filters.flood_window_s:.0f}s",
                    )
                )
            if self.dups.observe(h, ts, rec.record_id):
                reasons.append(
                    QuarantineReason(
                        code="near_duplicate",
                        detail=f"prompt flood within {self.cfg.filters.dup_window_s:.0f}s",
                    )
                )
            pii = sp.counts + so.counts
            out.pii.update(pii)
            prov = Provenance(
                topic=m.topic,
                partition=m.partition,
                offset=m.offset,
                governed_at=governed_at,
                pii_entities=dict(pii),
                scrubbed=bool(pii),
                replaced=replaced_spans(sp, "prompt") + replaced_spans(so, "output"),
            )
            try:
                clean_rec = self._scrubbed_record(
                    rec, sp, so, keep_tokens=not any(r.code in ("inconsistent", "vocab") for r in reasons)
                )
            except Exception as exc:  # noqa: BLE001 - one record's re-tokenisation, not the batch's
                log.warning("re-tokenising record %s failed: %r", rec.record_id, exc)
                self._quarantine_unkept(
                    out, m, rec.record_id, rec.tenant_id, "retokenize", type(exc).__name__, governed_at
                )
                continue
            row = RecordRow(
                rec.record_id, rec.tenant_id, "clean", [], None, m.topic, m.partition, m.offset, ts, h
            )
            if reasons:
                row.status, row.reasons = "quarantined", [(r.code, r.detail) for r in reasons]
                out.reasons.update({r.code for r in reasons})
                # An opted-out tenant's text is not kept anywhere, not even scrubbed; nor is a
                # text the second PII layer was unsure about.
                keep = not any(r.code in ("consent", "pii_unsure") for r in reasons)
                out.quarantined.append(audit_quarantine(rec, reasons, prov, clean_rec if keep else None))
            else:
                out.clean.append(CleanRecord(record=clean_rec, provenance=prov))
            out.rows.append(row)

        pos = 2 * len(parsed)
        for (m, code, detail), (raw, strings) in zip(failed, raw_texts, strict=True):
            n = len(strings)
            done = scrubbed[pos : pos + n]
            pos += n
            if any(s is None or s.unsure for s in done):  # cannot store its text scrubbed: keep none
                self._quarantine_unkept(out, m, _message_id(m), None, code, detail, governed_at)
                continue
            scrubbed_raw = _rebuild(raw, [s.text for s in done])
            for s in done:
                out.pii.update(s.counts)
            rid = _message_id(m)
            prov = Provenance(topic=m.topic, partition=m.partition, offset=m.offset, governed_at=governed_at)
            out.quarantined.append(
                QuarantineRecord(
                    record_id=rid,
                    reasons=[QuarantineReason(code=code, detail=detail)],
                    provenance=prov,
                    raw_sha256=hashlib.sha256(m.value).hexdigest(),
                    raw_scrubbed=scrubbed_raw,
                )
            )
            out.reasons[code] += 1
            out.rows.append(
                RecordRow(
                    rid,
                    None,
                    "quarantined",
                    [(code, detail)],
                    None,
                    m.topic,
                    m.partition,
                    m.offset,
                    None,
                    None,
                )
            )
        for m, code, detail in unread:
            self._quarantine_unkept(out, m, _message_id(m, peek=False), None, code, detail, governed_at)
        out.timings["retokenise + filters"] += time.perf_counter() - t
        if out.n_in != len(out.clean) + len(out.quarantined) + out.n_duplicate:
            raise AssertionError("governance lost or invented records: conservation check failed")
        return out

    # -- per-record failure isolation ------------------------------------------------------------------
    def _check_isolated(self, parsed: list[tuple[Message, FeedbackRecord]], failed) -> dict:
        """GX reasons by record id; if the suite raises on the batch, each record is checked alone
        and those that still raise are listed under `_FAILED` (quarantined as `check_failed`)."""
        records = [r for _, r in parsed]
        try:
            return self.validator.reasons(records)
        except Exception as exc:  # noqa: BLE001 - find the record(s) that make it raise
            log.warning(
                "validation of a batch of %d raised %r: checking records one by one", len(records), exc
            )
        out: dict = {_FAILED: set()}
        for r in records:
            try:
                out.update(self.validator.reasons([r]))
            except Exception:  # noqa: BLE001
                out[_FAILED].add(r.record_id)
        return out

    def _scrub_isolated(self, texts: list[str], **kw) -> list:
        """Scrub results, None for a text the scrubber raised on (retried one by one)."""
        try:
            return self.scrubber.scrub(texts, **kw)
        except Exception as exc:  # noqa: BLE001
            log.warning("scrubbing %d texts raised %r: scrubbing them one by one", len(texts), exc)
        out = []
        for text in texts:
            try:
                out.append(self.scrubber.scrub([text])[0])
            except Exception:  # noqa: BLE001
                out.append(None)
        return out

    def _quarantine_unkept(
        self, out: BatchOutcome, m: Message, rid: str | None, tenant: str | None, code: str, detail: str, at
    ) -> None:
        """Quarantine a message whose content cannot be stored safely (not read, not scrubbed):
        only its reason and the hash of its bytes are kept."""
        prov = Provenance(topic=m.topic, partition=m.partition, offset=m.offset, governed_at=at)
        out.quarantined.append(
            QuarantineRecord(
                record_id=rid,
                reasons=[QuarantineReason(code=code, detail=detail)],
                provenance=prov,
                raw_sha256=hashlib.sha256(m.value).hexdigest(),
            )
        )
        out.reasons[code] += 1
        out.rows.append(
            RecordRow(
                rid, tenant, "quarantined", [(code, detail)], None, m.topic, m.partition, m.offset, None, None
            )
        )

    def _scrubbed_record(self, rec: FeedbackRecord, sp, so, keep_tokens: bool) -> FeedbackRecord:
        """The record with PII spans replaced in text and token ids; rounds re-mapped or dropped."""
        tok = self.vocab.tokenizer
        if not (sp.spans or so.spans):
            return rec
        if not keep_tokens:  # ids that do not match the text cannot be scrubbed reliably: drop them
            return rec.model_copy(
                update={
                    "prompt_text": sp.text,
                    "output_text": so.text,
                    "prompt_token_ids": [],
                    "output_token_ids": [],
                    "rounds": [],
                }
            )
        p = scrub_token_ids(rec.prompt_token_ids, rec.prompt_text, sp.spans, tok)
        o = scrub_token_ids(rec.output_token_ids, rec.output_text, so.spans, tok)
        rounds = []
        n_old = len(rec.output_token_ids)
        for r in rec.rounds:
            span = range(r.start, min(r.start + r.accepted + 1, n_old - 1) + 1)
            mapped = [o.index_map[j] for j in span]
            # A round whose tokens were rewritten no longer says anything true about them: drop it.
            if (
                mapped
                and all(j is not None for j in mapped)
                and mapped == list(range(mapped[0], mapped[0] + len(mapped)))
            ):
                rounds.append(
                    RoundRecord(start=mapped[0], verify_len=r.verify_len, accepted=r.accepted, a_hat=r.a_hat)
                )
        return rec.model_copy(
            update={
                "prompt_text": sp.text,
                "output_text": so.text,
                "prompt_token_ids": p.token_ids,
                "output_token_ids": o.token_ids,
                "rounds": rounds,
            }
        )

    # -- durability -----------------------------------------------------------------------------------
    def persist(self, out: BatchOutcome, started: datetime, producer: Any | None) -> BatchAudit:
        """Shards, then topics (acknowledged), then lineage + audit in one transaction."""
        groups: dict[tuple[str, str], list[CleanRecord]] = defaultdict(list)
        for c in out.clean:
            groups[(c.record.tenant_id, c.record.created_at.strftime("%Y-%m-%d"))].append(c)
        shards = []
        shard_of: dict[str, str] = {}
        for (tenant, date), recs in sorted(groups.items()):
            info = self.buffer.write_shard(tenant, date, recs)
            shards.append(
                ShardRow(
                    info.shard_id, str(info.path.relative_to(self.buffer.root)), tenant, date, info.n_records
                )
            )
            shard_of.update({c.record.record_id: info.shard_id for c in recs})
        for row in out.rows:
            row.shard_id = shard_of.get(row.record_id)
        if producer is not None:
            futures = [
                producer.send(
                    topics.CLEAN, key=c.record.tenant_id.encode(), value=c.model_dump_json().encode()
                )
                for c in out.clean
            ]
            futures += [
                producer.send(
                    topics.QUARANTINE, key=(q.record_id or "").encode(), value=q.model_dump_json().encode()
                )
                for q in out.quarantined
            ]
            producer.flush()
            for f in futures:
                f.get(timeout=30)  # raises: the batch is not acknowledged, offsets stay uncommitted
        finished = datetime.now(UTC)
        audit = BatchAudit(
            batch_id=uuid.uuid4().hex,
            started_at=started.isoformat(),
            finished_at=finished.isoformat(),
            offsets=out.offsets,
            n_in=out.n_in,
            n_clean=len(out.clean),
            n_quarantined=len(out.quarantined),
            n_duplicate=out.n_duplicate,
            reasons=dict(out.reasons),
            pii_entities=dict(out.pii),
            seconds=(finished - started).total_seconds(),
        )
        self.lineage.commit_batch(audit, out.rows, shards)
        return audit


class GovernanceService:
    """Kafka loop around a `Governor`: poll a batch, govern, persist, then commit offsets."""

    def __init__(self, cfg: GovernanceConfig, governor: Governor) -> None:
        from kafka import KafkaConsumer, KafkaProducer

        self.cfg = cfg
        self.governor = governor
        self.consumer = KafkaConsumer(
            topics.RAW,
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=cfg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=cfg.batch_size,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )
        self.producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", linger_ms=5)

    def run_once(self) -> BatchAudit | None:
        polled = self.consumer.poll(timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.batch_size)
        messages = [
            Message(tp.topic, tp.partition, m.offset, m.key, m.value)
            for tp, msgs in polled.items()
            for m in msgs
        ]
        if not messages:
            return None
        started = datetime.now(UTC)
        out = self.governor.govern(messages)
        audit = self.governor.persist(out, started, self.producer)
        self.consumer.commit()  # only now: every output above is durable
        log.info(
            "batch %s: in=%d clean=%d quarantined=%d duplicate=%d",
            audit.batch_id[:8],
            audit.n_in,
            audit.n_clean,
            audit.n_quarantined,
            audit.n_duplicate,
        )
        return audit

    def run(self, max_batches: int | None = None, idle_exit_s: float | None = None, on_batch=None) -> int:
        n, idle_since = 0, time.monotonic()
        while max_batches is None or n < max_batches:
            audit = self.run_once()
            if audit is None:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            n += 1
            idle_since = time.monotonic()
            if on_batch is not None:
                on_batch(audit)
        return n

    def close(self) -> None:
        self.consumer.close()
        self.producer.close(timeout=5)
        self.governor.lineage.close()


# -- poison-pill caps -----------------------------------------------------------------------------------
_FAILED = "\x00failed"  # key of _check_isolated's set of records the suite raised on
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth_exceeds(value: bytes, cap: int) -> bool:
    """Whether JSON nesting goes deeper than `cap`, without parsing (brackets inside strings do
    not count). Only payloads with more than `cap` brackets are scanned at all."""
    if value.count(b"[") + value.count(b"{") <= cap:
        return False
    depth = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub(b'""', value)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > cap:
                return True
        else:
            depth -= 1
    return False


def _over_caps(value: bytes, cfg: GovernanceConfig) -> tuple[str, str] | None:
    """(reason code, detail) for a payload too big or too deep to read, else None."""
    if len(value) > cfg.max_payload_bytes:
        return "too_large", f"{len(value)} bytes > the {cfg.max_payload_bytes}-byte cap"
    if json_depth_exceeds(value, cfg.max_json_depth):
        return "too_deep", f"JSON nested deeper than {cfg.max_json_depth} levels"
    return None


# -- helpers for payloads that did not parse ---------------------------------------------------------
def _peek_id(value: bytes) -> str | None:
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    rid = data.get("record_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None


def _message_id(m: Message, peek: bool = True) -> str:
    """The record id, or for a payload without one an id of this message: identical garbage sent
    twice is two messages, each quarantined; the same message redelivered is a duplicate. A
    payload over the caps is not peeked into (`peek=False`): it gets the message id."""
    rid = _peek_id(m.value) if peek else None
    if rid:
        return rid
    digest = hashlib.sha256(m.value).hexdigest()[:24]
    return f"unparsed-{digest}-{m.topic}-{m.partition}-{m.offset}"


def _schema_code(value: bytes) -> str:
    """`missing_fields` for a current-version object lacking required fields, else `schema`."""
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        return "schema"
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        return "schema"
    required = {n for n, f in FeedbackRecord.model_fields.items() if f.is_required()}
    return "missing_fields" if required - data.keys() else "schema"


def _strings_of_failed(failed: list[tuple[Message, str, str]]) -> list[tuple[Any, list[str]]]:
    """(parsed JSON or raw text, its strings in order) — every string gets scrubbed before storage."""
    out = []
    for m, _, _ in failed:
        try:
            data: Any = json.loads(m.value)
        except (ValueError, RecursionError):
            data = m.value.decode("utf-8", errors="replace")
        if isinstance(data, dict):  # token ids encode the same text: they cannot be kept unscrubbed
            data = {k: v for k, v in data.items() if not k.endswith("token_ids")}
        strings: list[str] = []
        _walk(data, strings.append)
        out.append((data, strings))
    return out


def _walk(x: Any, visit) -> Any:
    if isinstance(x, str):
        return visit(x)
    if isinstance(x, dict):
        return {k: _walk(v, visit) for k, v in x.items()}
    if isinstance(x, list):
        return [_walk(v, visit) for v in x]
    return x


def _rebuild(data: Any, scrubbed: list[str]) -> str:
    it = iter(scrubbed)
    rebuilt = _walk(data, lambda _s: next(it))
    return rebuilt if isinstance(rebuilt, str) else json.dumps(rebuilt)
