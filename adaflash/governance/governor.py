"""The governor: one batch of raw feedback in; clean records, quarantine and an audit trail out.

Independent of Kafka (`service.py` feeds it; tests and benchmarks may too). `govern` runs the
stages of the pipeline in DESIGN §2, one method each:

  parse      dedupe by record id; payloads over the caps are not read; unknown version /
             unparseable → `schema`                                          (`_parse`)
  validate   the Great Expectations suite → vocab/length/rounds/... reasons   (`_validate`)
  scrub      Presidio PII scrub of prompt and output, and of every string of an unparsed
             payload                                                          (`_scrub`)
  route      per record: re-tokenise only the scrubbed spans and re-map rounds; flood and
             near-duplicate filters; clean or quarantined, and why            (`_route`)
  persist    Parquet shards + clean topic, quarantine topic → lineage + audit in one
             transaction                                                      (`persist`)

For every batch in = clean + quarantined + duplicate, and `govern` checks it.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from adaflash.feedback import topics
from adaflash.feedback.schema import (
    CleanRecord,
    FeedbackRecord,
    Provenance,
    QuarantineReason,
    QuarantineRecord,
    SchemaError,
    parse_record,
)
from adaflash.governance.batch import BatchOutcome, Message, ParsedBatch, ScrubbedBatch
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.checks import RecordValidator, non_finite_fields
from adaflash.governance.config import GovernanceConfig
from adaflash.governance.filters import FloodFilter, NearDuplicateFilter, minhash
from adaflash.governance.lineage import BatchAudit, LineageStore, RecordRow, ShardRow
from adaflash.governance.payloads import message_id, over_caps, rebuild, schema_code, strings_of
from adaflash.governance.pii import PiiScrubber, replaced_spans
from adaflash.governance.quarantine import audit_quarantine, process_key
from adaflash.governance.retokenize import scrub_token_ids
from adaflash.models.targets import Vocabulary

log = logging.getLogger(__name__)
_FAILED = "\x00failed"  # key of _validate's set of records the suite raised on


def _tenant_path_ok(tenant: str) -> bool:
    return 0 < len(tenant) <= 64 and all(c.isalnum() or c in "-_." for c in tenant) and tenant[0] != "."


def _sha256(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


def _readable(clean: CleanRecord) -> bool:
    """Whether the record reads back from the JSON the buffer stores: what `ingest` will do."""
    try:
        return CleanRecord.model_validate_json(clean.model_dump_json()) is not None
    except ValueError:  # pydantic's ValidationError is a ValueError
        return False


class Governor:
    """The per-batch logic, independent of Kafka (the service feeds it; tests may too)."""

    def __init__(
        self,
        cfg: GovernanceConfig,
        vocab: Vocabulary,
        scrubber: PiiScrubber | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        process_key()  # a missing or unreadable quarantine hash key fails here, at start
        self.cfg = cfg
        self.clock = clock  # governance's own time: a record's created_at may not run ahead of it
        self.vocab = vocab
        self.scrubber = scrubber or PiiScrubber()
        self.validator = RecordValidator(vocab.tokenizer, vocab.vocab_size, vocab.fingerprint, cfg.limits)
        self.lineage = LineageStore(cfg.lineage_path)
        self.buffer = ReplayBuffer(cfg.buffer_dir)
        removed = self.buffer.remove_orphans(self.lineage.shard_ids())
        if removed:
            log.warning("removed %d orphan shard(s) left by an interrupted batch", len(removed))
        self.flood = FloodFilter(cfg.filters, clock)
        self.dups = NearDuplicateFilter(cfg.filters, clock)
        self._rebuild_windows()

    def _rebuild_windows(self) -> None:
        latest = self.lineage.latest_event_time()
        if latest is None:
            return
        f = self.cfg.filters  # late events still count against a window: keep the lateness too
        ahead = self.clock() + f.max_future_skew_s  # a future date stored before issue 32: not the clock
        latest = min(latest, ahead)
        horizon = latest - max(f.flood_window_s, f.dup_window_s) - f.max_lateness_s
        for tenant, ts, h in self.lineage.recent(horizon):
            if ts > ahead:
                continue
            if tenant is not None and ts >= latest - f.flood_window_s - f.max_lateness_s:
                self.flood.observe(tenant, ts)
            if h is not None:
                self.dups.observe(h, ts)

    # -- the batch: parse → validate → scrub → route (then `persist`) ---------------------------------
    def govern(self, messages: list[Message]) -> BatchOutcome:
        out = BatchOutcome(n_in=len(messages))
        t = time.perf_counter()
        batch = self._parse(messages, out)
        out.timings["parse"] += time.perf_counter() - t

        t = time.perf_counter()
        gx_reasons = self._validate(batch.parsed)
        out.timings["validate (GX)"] += time.perf_counter() - t

        t = time.perf_counter()
        scrubbed = self._scrub(batch)
        out.timings["PII scrub (Presidio)"] += time.perf_counter() - t

        t = time.perf_counter()
        self._route(batch, gx_reasons, scrubbed, out)
        out.timings["retokenise + filters"] += time.perf_counter() - t
        if out.n_in != len(out.clean) + len(out.quarantined) + out.n_duplicate:
            raise AssertionError("governance lost or invented records: conservation check failed")
        return out

    def _parse(self, messages: list[Message], out: BatchOutcome) -> ParsedBatch:
        """Offsets seen, duplicates counted (known to the lineage store or twice in the batch),
        payloads over the caps set aside unread, the rest parsed or failed with a reason."""
        for m in messages:
            key = f"{m.topic}/{m.partition}"
            lo, hi = out.offsets.get(key, [m.offset, m.offset])
            out.offsets[key] = [min(lo, m.offset), max(hi, m.offset)]
        batch = ParsedBatch()
        caps = [over_caps(m.value, self.cfg) for m in messages]
        candidate_ids = [message_id(m, peek=cap is None) for m, cap in zip(messages, caps, strict=True)]
        ids = [i for i in candidate_ids if i]
        # A duplicate is an id already clean, or the same bytes under an id again (a redelivery).
        # A quarantined message does not hold its id: a later valid record with it is governed.
        clean, seen = self.lineage.clean_ids(ids), self.lineage.quarantined_payloads(ids)
        for m, rid, cap in zip(messages, candidate_ids, caps, strict=True):
            key = (rid, _sha256(m.value))
            if rid and (rid in clean or key in seen):
                out.n_duplicate += 1
                continue
            seen.add(key)
            if cap is not None:
                batch.unread.append((m, *cap))
                continue
            try:
                rec = parse_record(m.value)
            except SchemaError as exc:
                batch.failed.append((m, schema_code(m.value), str(exc)))
                continue
            # A non-finite number is not a value any stage may judge (GX, the filters) and JSON
            # cannot store it: the payload is set aside like one that did not parse (issue 32).
            bad = non_finite_fields(rec)
            if bad:
                batch.failed.append((m, "non_finite", f"non-finite number in {', '.join(bad)}"))
            else:
                batch.parsed.append((m, rec))
        return batch

    def _scrub(self, batch: ParsedBatch) -> ScrubbedBatch:
        """One scrubber call for the batch: prompt and output of every parsed record, and every
        string of every payload that did not parse."""
        texts = [x for _, r in batch.parsed for x in (r.prompt_text, r.output_text)]
        raw_texts = strings_of(batch.failed)
        # Texts of one record share its surrogates (the same fake name in prompt and output).
        groups = [i // 2 for i in range(len(texts))]
        groups += [("raw", j) for j, (_, strings) in enumerate(raw_texts) for _ in strings]
        done = self._scrub_isolated(texts + [s for _, strings in raw_texts for s in strings], groups=groups)
        records = [(done[2 * i], done[2 * i + 1]) for i in range(len(batch.parsed))]
        raw, pos = [], 2 * len(batch.parsed)
        for data, strings in raw_texts:
            raw.append((data, done[pos : pos + len(strings)]))
            pos += len(strings)
        return ScrubbedBatch(records, raw)

    def _route(
        self, batch: ParsedBatch, gx_reasons: dict, scrubbed: ScrubbedBatch, out: BatchOutcome
    ) -> None:
        """Every message of the batch to exactly one place: clean, quarantined (with reasons and
        what may be kept of it), or — unreadable or unscrubbable — quarantined with its hash only."""
        governed_at = datetime.now(UTC)
        for (m, rec), (sp, so) in zip(batch.parsed, scrubbed.records, strict=True):
            if sp is None or so is None or rec.record_id in gx_reasons.get(_FAILED, ()):
                longest = max(len(rec.prompt_text), len(rec.output_text))
                if longest > self.cfg.max_scrub_chars:
                    cap = self.cfg.max_scrub_chars
                    why = ("too_large", f"a text of {longest} characters > the {cap}-character scrub cap")
                elif sp is None or so is None:
                    why = ("scrub_failed", "PII scrubbing raised")
                else:
                    why = ("check_failed", "validation raised")
                self._quarantine_message(out, m, rec.record_id, rec.tenant_id, *why, governed_at)
                continue
            self._route_record(m, rec, sp, so, gx_reasons.get(rec.record_id, []), governed_at, out)
        for (m, code, detail), (data, done) in zip(batch.failed, scrubbed.raw, strict=True):
            self._route_unparsed(m, code, detail, data, done, governed_at, out)
        for m, code, detail in batch.unread:
            self._quarantine_message(out, m, message_id(m, peek=False), None, code, detail, governed_at)

    def _reasons(self, rec: FeedbackRecord, sp, so, gx: list, ts: float, h) -> list[QuarantineReason]:
        """Why a parsed, scrubbed record may not train: the suite's reasons, then the tenant id,
        PII doubt, and the flood and near-duplicate filters (which also count it)."""
        reasons = [QuarantineReason(code=c, detail=d) for c, d in gx]
        if not _tenant_path_ok(rec.tenant_id):
            reasons.append(QuarantineReason(code="values", detail="tenant_id: 1-64 of [A-Za-z0-9._-]"))
        if sp.unsure or so.unsure:  # the second PII layer could not decide: keep no text
            doubt = "; ".join(sorted({*sp.unsure, *so.unsure}))
            reasons.append(QuarantineReason(code="pii_unsure", detail=doubt))
        f = self.cfg.filters
        ahead = ts - self.clock()
        if ahead > f.max_future_skew_s:
            # Not traffic the filters may count: its time would stretch their windows (issue 32).
            detail = f"created_at is {ahead:.0f}s ahead of governance's clock"
            return [*reasons, QuarantineReason(code="future", detail=detail)]
        if self.flood.observe(rec.tenant_id, ts, rec.record_id):
            detail = f"> {f.flood_max_per_window} requests per {f.flood_window_s:.0f}s"
            reasons.append(QuarantineReason(code="flood", detail=detail))
        if self.dups.observe(h, ts, rec.record_id):
            detail = f"prompt flood within {f.dup_window_s:.0f}s"
            reasons.append(QuarantineReason(code="near_duplicate", detail=detail))
        return reasons

    def _route_record(self, m: Message, rec: FeedbackRecord, sp, so, gx: list, governed_at: datetime,
                      out: BatchOutcome) -> None:  # fmt: skip
        ts = rec.created_at.timestamp()
        h = minhash(sp.masked)  # surrogates differ per record; placeholders do not
        reasons = self._reasons(rec, sp, so, gx, ts, h)
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
            self._quarantine_message(
                out, m, rec.record_id, rec.tenant_id, "retokenize", type(exc).__name__, governed_at
            )
            return
        if any(r.code == "future" for r in reasons):
            ts, h = None, None  # never observed by the filters: not rebuilt into them after a restart
        row = RecordRow(
            rec.record_id, rec.tenant_id, "clean", [], None, m.topic, m.partition, m.offset, ts, h,
            _sha256(m.value),
        )  # fmt: skip
        if not reasons and rec.record_id in out.clean_ids:  # the same id clean twice in one batch
            out.n_duplicate += 1
            return
        if reasons:
            row.status, row.reasons = "quarantined", [(r.code, r.detail) for r in reasons]
            out.reasons.update({r.code for r in reasons})
            # An opted-out tenant's text is not kept anywhere, not even scrubbed; nor is a
            # text the second PII layer was unsure about.
            keep = not any(r.code in ("consent", "pii_unsure") for r in reasons)
            out.quarantined.append(audit_quarantine(rec, reasons, prov, clean_rec if keep else None))
        else:
            clean = CleanRecord(record=clean_rec, provenance=prov)
            if not _readable(clean):  # a clean shard must always read back (issue 32)
                why = ("unreadable", "does not read back as JSON")
                self._quarantine_message(out, m, rec.record_id, rec.tenant_id, *why, governed_at)
                return
            out.clean.append(clean)
            out.clean_ids.add(rec.record_id)
        out.rows.append(row)

    def _route_unparsed(self, m: Message, code: str, detail: str, data: Any, done: list,
                        governed_at: datetime, out: BatchOutcome) -> None:  # fmt: skip
        """A payload that did not parse: quarantined with its strings scrubbed, or — when one of
        them could not be scrubbed for sure — with its hash only."""
        if any(s is None or s.unsure for s in done):  # cannot store its text scrubbed: keep none
            self._quarantine_message(out, m, message_id(m), None, code, detail, governed_at)
            return
        for s in done:
            out.pii.update(s.counts)
        scrubbed_raw = rebuild(data, [s.text for s in done])
        self._quarantine_message(out, m, message_id(m), None, code, detail, governed_at, scrubbed_raw)

    # -- per-record failure isolation ------------------------------------------------------------------
    def _validate(self, parsed: list[tuple[Message, FeedbackRecord]]) -> dict:
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

    def _scrub_isolated(self, texts: list[str], groups: list) -> list:
        """Scrub results, None for a text over the scrub cap (never scrubbed) or one the scrubber
        raised on (retried one by one)."""
        keep = [i for i, t in enumerate(texts) if len(t) <= self.cfg.max_scrub_chars]
        out: list = [None] * len(texts)
        done = self._scrub_all([texts[i] for i in keep], [groups[i] for i in keep])
        for i, r in zip(keep, done, strict=True):
            out[i] = r
        return out

    def _scrub_all(self, texts: list[str], groups: list) -> list:
        if not texts:
            return []
        try:
            return self.scrubber.scrub(texts, groups=groups)
        except Exception as exc:  # noqa: BLE001
            log.warning("scrubbing %d texts raised %r: scrubbing them one by one", len(texts), exc)
        out = []
        for text in texts:
            try:
                out.append(self.scrubber.scrub([text])[0])
            except Exception:  # noqa: BLE001
                out.append(None)
        return out

    def _quarantine_message(self, out: BatchOutcome, m: Message, rid: str | None, tenant: str | None,
                           code: str, detail: str, at, raw_scrubbed: str | None = None) -> None:  # fmt: skip
        """Quarantine a message that is not kept as a record (not read, not parsed, not scrubbed):
        its reason and the hash of its bytes, and for an unparsed payload whose every string was
        scrubbed, that scrubbed text (`raw_scrubbed`)."""
        prov = Provenance(topic=m.topic, partition=m.partition, offset=m.offset, governed_at=at)
        out.quarantined.append(
            QuarantineRecord(
                record_id=rid,
                reasons=[QuarantineReason(code=code, detail=detail)],
                provenance=prov,
                raw_sha256=hashlib.sha256(m.value).hexdigest(),
                raw_scrubbed=raw_scrubbed,
            )
        )
        out.reasons[code] += 1
        out.rows.append(
            RecordRow(
                rid,
                tenant,
                "quarantined",
                [(code, detail)],
                None,
                m.topic,
                m.partition,
                m.offset,
                None,
                None,
                _sha256(m.value),
            )  # fmt: skip
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
                rounds.append(r.model_copy(update={"start": mapped[0]}))
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
