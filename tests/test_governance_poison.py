"""Poison pills cannot stop governance (issue 14): a payload too big or too deep to read, or one
that makes a stage raise, is quarantined with its reason and the batch goes on; for every batch
in = clean + quarantined + duplicate, and every good record around the poison comes out clean."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from adaflash.feedback import topics
from adaflash.feedback.schema import parse_record
from adaflash.governance.filters import FilterConfig
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.payloads import json_depth_exceeds
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
