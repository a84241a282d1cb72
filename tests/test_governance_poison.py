"""Poison pills cannot stop governance (issue 14): a payload too big or too deep to read, or one
that makes a stage raise, is quarantined with its reason and the batch goes on; for every batch
in = clean + quarantined + duplicate, and every good record around the poison comes out clean."""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import UTC, datetime

import pytest

from adaflash.components.ingest import ingest
from adaflash.feedback import topics
from adaflash.feedback.schema import parse_record
from adaflash.governance.buffer import ReplayBuffer
from adaflash.governance.filters import FilterConfig
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.payloads import json_depth_exceeds
from adaflash.governance.pii_rules import second_pass
from adaflash.governance.synthetic import TrafficGenerator
from adaflash.workloads import load_prompts

# Generous filters: this test is about poison, not floods of similar prompts.
FILTERS = FilterConfig(flood_max_per_window=10_000, dup_max_similar=10_000)
N_GOOD = 1000


def _record_json(gen: TrafficGenerator) -> dict:
    return json.loads(gen.normal(pii_fraction=0.0).value)


def _poison(gen: TrafficGenerator) -> dict[str, bytes]:
    """Payloads that used to crash `adaflash governance run` (or could), by expected reason."""
    big = _record_json(gen)
    big["prompt_text"] = "x" * (5 * 1024 * 1024)  # 5 MB: spaCy's length limit in pii.py
    surrogate = _record_json(gen)
    surrogate["output_text"] = "ok \ud800 then"  # json.dumps escapes it: valid JSON, invalid text
    huge_int = json.dumps(_record_json(gen))[:-1] + ', "n": ' + "9" * 5000 + "}"
    return {
        "too_large": json.dumps(big).encode(),
        "too_deep": b"[" * 10_000 + b"]" * 10_000,  # RecursionError in _message_id
        "too_deep ": b'{"schema_version": 1, "x": ' + b"[" * 900 + b"]" * 900 + b"}",  # under Python's limit
        "schema": json.dumps(surrogate).encode(),
        "schema ": huge_int.encode(),  # int() of 5000 digits raises ValueError in json.loads
        "schema  ": b"\xff\xfe not even UTF-8 {[",
    }


def test_depth_scan_ignores_brackets_inside_strings():
    assert not json_depth_exceeds(json.dumps({"t": "[" * 100 + "{" * 100}).encode(), 8)
    assert json_depth_exceeds(b'{"a": ' + b"[" * 9 + b"]" * 9 + b"}", 8)
    assert not json_depth_exceeds(b'{"a": ' + b"[" * 7 + b"]" * 7 + b"}", 8)
    assert not json_depth_exceeds(b'{"a": "\\"[[[[[[[[[[["}', 4)  # an escaped quote stays inside


def test_poison_in_the_middle_of_good_records_is_quarantined_and_the_batch_goes_on(tmp_path, vocab, scrubber):
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:400]], seed=5)
    good = [gen.normal(pii_fraction=0.3) for _ in range(N_GOOD)]
    poison = _poison(gen)
    values = [m.value for m in good]
    keys = [m.key for m in good]
    half = N_GOOD // 2
    for j, v in enumerate(poison.values()):  # in the middle, between good records
        values.insert(half + 2 * j, v)
        keys.insert(half + 2 * j, None)
    msgs = [Message(topics.RAW, 0, i, k, v) for i, (k, v) in enumerate(zip(keys, values, strict=True))]

    cfg = GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS, batch_size=len(msgs))
    gov = Governor(cfg, vocab, scrubber)
    out = gov.govern(msgs)
    gov.persist(out, datetime.now(UTC), None)  # the outputs become durable: nothing in them chokes Parquet

    assert out.n_in == len(out.clean) + len(out.quarantined) + out.n_duplicate == len(msgs)
    clean_ids = {c.record.record_id for c in out.clean}
    good_ids = {m.planted.record_id for m in good}
    assert good_ids <= clean_ids  # every good record around the poison is clean
    by_offset = {q.provenance.offset: q for q in out.quarantined}
    for j, code in enumerate(poison):
        q = by_offset[half + 2 * j]
        assert [r.code for r in q.reasons] == [code.strip()], (code, q.reasons)
        # A payload too big/deep to read keeps nothing but its hash: no unscrubbed text at rest.
        if code.startswith("too_"):
            assert q.raw_scrubbed is None and q.record is None and q.raw_sha256
    assert gov.lineage.totals()["quarantined"] == len(poison)

    # Redelivery (a restart before the offsets were committed): all duplicates, nothing crashes.
    again = gov.govern(msgs[half - 3 : half + 2 * len(poison) + 3])
    assert again.n_duplicate == again.n_in and not again.clean and not again.quarantined


def test_a_stage_that_raises_on_one_record_quarantines_only_that_record(tmp_path, vocab, scrubber):
    """Any per-record failure (here: the scrubber raising on one text, as spaCy does past its
    length limit) quarantines that record with a reason; its neighbours are governed normally."""
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:200]], seed=6)
    good = [gen.normal(pii_fraction=0.0) for _ in range(30)]
    bad = _record_json(gen)
    bad["prompt_text"] = "TRIGGER " + bad["prompt_text"]
    bad["prompt_token_ids"] = vocab.tokenizer.encode(bad["prompt_text"])
    values = [m.value for m in good[:15]] + [json.dumps(bad).encode()] + [m.value for m in good[15:]]
    msgs = [Message(topics.RAW, 0, i, None, v) for i, v in enumerate(values)]

    class Fragile:
        """The real scrubber, which raises on texts with the trigger (a stand-in for an input
        that breaks spaCy or Presidio)."""

        def scrub(self, texts, **kw):
            if any(t.startswith("TRIGGER") for t in texts):
                raise ValueError("[E088] Text of length 2000000 exceeds maximum of 1000000")
            return scrubber.scrub(texts, **kw)

    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS), vocab, Fragile())
    out = gov.govern(msgs)
    gov.persist(out, datetime.now(UTC), None)
    assert out.n_in == len(out.clean) + len(out.quarantined) + out.n_duplicate
    assert {c.record.record_id for c in out.clean} == {parse_record(m.value).record_id for m in good}
    (q,) = out.quarantined
    assert q.record_id == bad["record_id"] and q.reasons[0].code == "scrub_failed"
    assert q.record is None and q.raw_scrubbed is None  # its text was never scrubbed: not kept


# -- issue 32: non-finite numbers ------------------------------------------------------------------------
# Every numeric field of a raw record a JSON reader can fill with a non-finite float: Python's
# json reads 1e400 as inf and the NaN/Infinity literals as such, and pydantic accepts them.
NON_FINITE = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"]
NUMERIC_FIELDS = [
    ("gamma",),
    ("sampling", "temperature"),
    ("sampling", "top_p"),
    ("latency", "ttft_ms"),
    ("latency", "e2e_ms"),
    ("latency", "itl_ms", 0),
    ("rounds", 0, "a_hat"),
]
_MARK = 123456.75  # a float json.dumps writes exactly, replaced by the literal in the text


def _with_literal(rec: dict, path: tuple, literal: str) -> bytes:
    node = rec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = _MARK
    text = json.dumps(rec)
    assert text.count(str(_MARK)) == 1
    return text.replace(str(_MARK), literal).encode()


def _all_finite(x) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_all_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_all_finite(v) for v in x)
    return True


def test_non_finite_numbers_are_quarantined_and_every_shard_stays_readable(tmp_path, vocab, scrubber):
    """Invariants: every numeric field in a clean record is finite; a clean shard is always
    readable. A poison number used to pass as clean, be written as null and make the tenant's
    shard (its normal records too) unreadable, so `ingest` failed on every later run."""
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:100]], seed=9, tenants=1)
    good = [gen.normal(pii_fraction=0.0) for _ in range(20)]
    poison = {}
    for path in NUMERIC_FIELDS:
        for literal in NON_FINITE:
            rec = _record_json(gen)
            poison[rec["record_id"]] = (".".join(map(str, path)), _with_literal(rec, path, literal))
    values = [m.value for m in good] + [v for _, v in poison.values()]
    msgs = [Message(topics.RAW, 0, i, b"tenant-00", v) for i, v in enumerate(values)]

    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS), vocab, scrubber)
    out = gov.govern(msgs)
    gov.persist(out, datetime.now(UTC), None)

    assert {c.record.record_id for c in out.clean} == {m.planted.record_id for m in good}
    assert all(_all_finite(c.record.model_dump()) for c in out.clean)
    by_id = {q.record_id: q for q in out.quarantined}
    for rid, (field, _) in poison.items():
        reasons = by_id[rid].reasons
        assert any(r.code == "non_finite" and field in r.detail for r in reasons), (field, reasons)
    shards = gov.buffer.shard_files()
    assert shards and sum(len(ReplayBuffer.read_shard(p)) for p in shards) == len(good)
    gov.lineage.close()
    snap = ingest(tmp_path / "gov", min_records=1)  # reads every shard after the poison
    assert len(snap.train) + len(snap.heldout) == len(good)
    assert snap.lineage["skipped_shards"] == [] and snap.lineage["skipped_records"] == 0


def test_ingest_skips_an_unreadable_shard_and_a_bad_row_with_a_reason(tmp_path, vocab, scrubber, caplog):
    """A shard that cannot be read (today's null-for-NaN rows, a torn file) is skipped with a
    logged reason and counted; it does not fail every later run, and the rest still trains."""
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:100]], seed=10, tenants=3)
    good = [gen.normal(pii_fraction=0.0) for _ in range(30)]
    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS), vocab, scrubber)
    out = gov.govern([Message(topics.RAW, 0, i, None, m.value) for i, m in enumerate(good)])
    gov.persist(out, datetime.now(UTC), None)
    rows = gov.lineage.shards()
    assert len(rows) >= 2
    torn, poisoned = (gov.buffer.root / r["path"] for r in rows[:2])
    torn.write_bytes(torn.read_bytes()[:100])  # a torn file: not Parquet any more
    recs = ReplayBuffer.read_shard(poisoned)
    bad = recs[0].model_copy(update={"record": recs[0].record.model_copy(update={"gamma": math.inf})})
    info = gov.buffer.write_shard(rows[1]["tenant_id"], rows[1]["date"], [bad, *recs[1:]])
    info.path.replace(poisoned)  # the shard as it was written before the fix: gamma null
    gov.lineage.close()

    caplog.set_level(logging.WARNING, logger="adaflash")
    snap = ingest(tmp_path / "gov", min_records=1)
    n_torn = rows[0]["n_records"]
    assert len(snap.train) + len(snap.heldout) == len(good) - n_torn - 1
    assert snap.lineage["skipped_shards"] == [rows[0]["shard_id"]]
    assert snap.lineage["skipped_records"] == n_torn + 1
    assert rows[0]["shard_id"] not in snap.shard_ids and rows[1]["shard_id"] in snap.shard_ids
    assert "unreadable" in caplog.text


# -- issue 32: one long word ------------------------------------------------------------------------------
# Shapes that made a pattern of the second PII pass quadratic (or worse) before: the work per start
# position grew with the word, and every position of the word was a start.
ADVERSARIAL_UNITS = ["A", "Ab", "0", "A'", "Via ", "a dot ", "+1", "mysql ", "a-", "a.", "eyJ-", "sk-", "A "]


@pytest.mark.parametrize("unit", ADVERSARIAL_UNITS)
def test_second_pii_pass_is_linear_on_adversarial_text(unit):
    text = (unit * (64_000 // len(unit) + 1))[:64_000]
    second_pass("John Smith, Via Roma 5")  # the name lists load once per process
    t = time.perf_counter()
    second_pass(text)
    assert time.perf_counter() - t < 2.0  # was 181 s for "+1", 5.6 s for "mysql ", 4.4 s for "a-"


@pytest.mark.parametrize("unit", ["Hauptstrasse", "A", "a-", "1 "])
def test_a_500_kb_single_word_record_is_governed_in_under_2_s(tmp_path, vocab, scrubber, unit):
    """A record under the 512 KiB cap whose prompt is one 500 KB word held governance for 352 s
    (the Germanic street-name pattern). Texts past the scrub cap are not scrubbed at all: the
    record is quarantined with its reason and keeps no text."""
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:50]], seed=12)
    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS), vocab, scrubber)
    gov.govern([Message(topics.RAW, 0, 0, None, gen.normal(pii_fraction=1.0).value)])  # warm
    rec = _record_json(gen)
    rec["prompt_text"] = (unit * (500_000 // len(unit) + 1))[:500_000]
    value = json.dumps(rec).encode()
    assert len(value) <= GovernanceConfig(data_dir=tmp_path).max_payload_bytes

    t = time.perf_counter()
    out = gov.govern([Message(topics.RAW, 0, 1, None, value)])
    gov.persist(out, datetime.now(UTC), None)
    assert time.perf_counter() - t < 2.0
    (q,) = out.quarantined
    assert "too_large" in [r.code for r in q.reasons] and q.prompt_scrubbed is None


def test_a_quarantined_record_does_not_shadow_a_valid_record_with_its_id(tmp_path, vocab, scrubber):
    """Issue 32: a valid record whose id was first used by a quarantined record was dropped as a
    duplicate. Only a clean id, or the same bytes again (a redelivery), is a duplicate."""
    by = load_prompts("train")
    gen = TrafficGenerator(vocab, [p.text for p in by["math"][:100]], seed=13)
    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=FILTERS), vocab, scrubber)
    first, second = gen.normal(pii_fraction=0.0), gen.normal(pii_fraction=0.0)
    bad_first = _record_json(gen) | {"record_id": first.planted.record_id, "block_size": 0}
    bad_second = {"schema_version": 1, "record_id": second.planted.record_id, "garbage": True}
    poison = [json.dumps(bad_first).encode(), json.dumps(bad_second).encode()]

    # The poison in one batch, the valid records in the next; then in one batch, poison first.
    out1 = gov.govern([Message(topics.RAW, 0, 0, None, poison[0])])
    gov.persist(out1, datetime.now(UTC), None)
    assert len(out1.quarantined) == 1
    out2 = gov.govern([Message(topics.RAW, 0, 1, None, first.value)])
    gov.persist(out2, datetime.now(UTC), None)
    assert [c.record.record_id for c in out2.clean] == [first.planted.record_id]
    out3 = gov.govern(
        [Message(topics.RAW, 0, 2, None, poison[1]), Message(topics.RAW, 0, 3, None, second.value)]
    )
    gov.persist(out3, datetime.now(UTC), None)
    assert [c.record.record_id for c in out3.clean] == [second.planted.record_id]
    assert len(out3.quarantined) == 1
    for rid in (first.planted.record_id, second.planted.record_id):
        assert gov.lineage.record(rid)["status"] == "clean"

    # Redelivered, every one of them is a duplicate: the clean ids and the same poison bytes.
    again = gov.govern([Message(topics.RAW, 0, i, None, v) for i, v in
                        enumerate([poison[0], first.value, poison[1], second.value])])  # fmt: skip
    assert again.n_duplicate == 4 and not again.clean and not again.quarantined
    # A record re-sent after its id is clean, even changed, stays a duplicate.
    twin = json.loads(first.value) | {"domain": "code"}
    assert gov.govern([Message(topics.RAW, 0, 9, None, json.dumps(twin).encode())]).n_duplicate == 1
