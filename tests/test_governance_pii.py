"""Issue 13: PII recall beyond the generator's own kinds, surrogates, false positives, quarantine.

Recall is measured at rest on the team's canary corpus (`tests/pii_canaries.py`, the tuning part,
and `tests/pii_canaries_heldback.py`, the part the tuning never looked at): every canary becomes a
record that goes through a real Tansu broker and `GovernanceService` (real Presidio + spaCy, GX,
Parquet, SQLite), and then the clean topic, the replay buffer, the quarantine topic, the lineage
store, every other file and the logs are searched for its secrets.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sqlite3
import unicodedata
from datetime import UTC, datetime, timedelta

import pytest

from adaflash.bench.pii_quality import probe_record
from adaflash.feedback import topics
from adaflash.feedback.schema import (
    CleanRecord,
    FeedbackRecord,
    QuarantineRecord,
)
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.pii import PiiScrubber
from adaflash.governance.service import GovernanceService
from adaflash.workloads import load_prompts
from tests.kafka_util import produce, read_topic, running_broker
from tests.pii_canaries import TUNING, Canary
from tests.pii_canaries_heldback import HELDBACK

FILLER = [
    "Sure. Here is how to approach it step by step: first collect the inputs, then check them.",
    "def total(xs):\n    return sum(x for x in xs if x > 0)\n",
    "The answer is 42. Let me know if anything else is unclear.",
]


def _corpus_records(vocab, corpus: list[Canary], seed: int) -> list[tuple[FeedbackRecord, Canary]]:
    """One record per canary, alternately in the prompt and in the output, amid ordinary text."""
    rng = random.Random(seed)
    t0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    base = ["Can you help me with this?", "Please check the following.", "Quick question about my order."]
    out = []
    for i, c in enumerate(corpus):
        if i % 2 == 0:
            prompt, output = f"{rng.choice(base)}\n{c.text}\nThanks in advance.", rng.choice(FILLER)
        else:
            prompt, output = rng.choice(base), f"{rng.choice(FILLER)}\n{c.text}\nAnything else?"
        out.append((probe_record(vocab, prompt, output, t0 + timedelta(seconds=7 * i), rng), c))
    return out


def _seen(s: str) -> str:
    """What a reader sees: NFKC, invisible format characters gone, every space a plain one."""
    s = unicodedata.normalize("NFKC", s)
    s = "".join(c for c in s if unicodedata.category(c) != "Cf")
    return re.sub(r"\s", " ", s).replace("\\u0040", "@")


def _leaks(c: Canary, text: str) -> list[str]:
    seen = _seen(text)
    bad = [s for s in c.secrets if s in text or _seen(s) in seen]
    bad += [p for p in c.name_parts if re.search(rf"(?<!\w){re.escape(p)}(?!\w)", text)]
    return bad


def _governed_at_rest(tmp_path, vocab, scrubber, records, caplog) -> tuple[dict[str, str], str]:
    """(record id -> everything stored about that record, everything else stored or logged)."""
    import pyarrow.parquet as pq

    from adaflash.governance.buffer import ReplayBuffer

    with running_broker(tmp_path / "broker") as broker:
        produce(broker.bootstrap_servers, topics.RAW, [(r.tenant_id.encode(), r.to_bytes()) for r in records])
        cfg = GovernanceConfig(
            data_dir=tmp_path / "gov", bootstrap_servers=broker.bootstrap_servers, batch_size=100
        )
        svc = GovernanceService(cfg, Governor(cfg, vocab, scrubber))
        svc.run(idle_exit_s=8)
        svc.close()
        clean = read_topic(broker.bootstrap_servers, topics.CLEAN)
        quarantine = read_topic(broker.bootstrap_servers, topics.QUARANTINE)
    per: dict[str, list[str]] = {r.record_id: [] for r in records}
    tok = vocab.tokenizer
    for m in clean:
        c = CleanRecord.model_validate_json(m.value)
        # the token ids are stored too: what they decode to is at rest as well
        ids_text = tok.decode(c.record.prompt_token_ids) + "\n" + tok.decode(c.record.output_token_ids)
        per[c.record.record_id] += [m.value.decode(), ids_text]
    for m in quarantine:
        q = QuarantineRecord.model_validate_json(m.value)
        per.setdefault(q.record_id or "", []).append(m.value.decode())
    for p in ReplayBuffer(cfg.data_dir / "buffer").shard_files():
        for row in pq.read_table(p).to_pylist():
            ids_text = tok.decode(row["prompt_token_ids"]) + "\n" + tok.decode(row["output_token_ids"])
            per[row["record_id"]] += [json.dumps(row, default=str, ensure_ascii=False), ids_text]
    db = sqlite3.connect(cfg.data_dir / "lineage.sqlite")
    rest = "\n".join(db.iterdump())
    db.close()
    rest += "\n".join(
        p.read_bytes().decode("utf-8", "replace")
        for p in cfg.data_dir.rglob("*")
        if p.is_file() and p.suffix not in (".parquet", ".sqlite")
    )
    rest += caplog.text
    return {k: "\n".join(v) for k, v in per.items()}, rest


@pytest.mark.parametrize("part", ["tuning", "heldback"])
def test_canary_corpus_recall_at_rest(part, tmp_path, vocab, scrubber, caplog):
    caplog.set_level(logging.DEBUG, logger="adaflash")
    corpus = TUNING if part == "tuning" else HELDBACK
    assert len({c.kind for c in corpus}) >= 25
    pairs = _corpus_records(vocab, corpus, seed=13 if part == "tuning" else 17)
    per, rest = _governed_at_rest(tmp_path, vocab, scrubber, [r for r, _ in pairs], caplog)
    missed = []
    for rec, c in pairs:
        stored = per[rec.record_id]
        assert stored, f"record {rec.record_id} is nowhere at rest: conservation broken"
        leaked = _leaks(c, stored) + [s for s in c.secrets if len(s) >= 6 and s in rest]
        if leaked:
            missed.append((c.kind, leaked))
    recall = 1 - len(missed) / len(pairs)
    print(f"{part}: record-level recall at rest {recall:.4f} ({len(pairs) - len(missed)}/{len(pairs)})")
    if part == "tuning":  # the held-back part's misses are not printed: nobody tunes against them
        print(missed)
    assert recall >= 0.99


def test_surrogates_are_consistent_realistic_and_retokenise_exactly(tmp_path, vocab, scrubber):
    from stdnum import iban, luhn

    prompt = (
        "Hi, I am Tomasz Wiśniewski, card 4539 1488 0343 6467, IBAN GB44 WFOQ 9664 2510 9720 67, "
        "mail tomasz.wisniewski@poczta.pl. Regards, Tomasz Wiśniewski"
    )
    output = "Thank you, Mr Wiśniewski. The card 4539 1488 0343 6467 was charged once."
    gen = random.Random(3)
    rec = probe_record(vocab, prompt, output, datetime(2026, 12, 1, tzinfo=UTC), gen)
    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov"), vocab, scrubber)
    out = gov.govern([Message(topics.RAW, 0, 0, None, rec.to_bytes())])
    assert len(out.clean) == 1
    c = out.clean[0]
    p, o = c.record.prompt_text, c.record.output_text
    assert "Wiśniewski" not in p + o and "4539" not in p + o and "<" not in p + o  # no placeholder
    cards = re.findall(r"\d{4} \d{4} \d{4} \d{4}", p)
    assert len(cards) == 1 and luhn.is_valid(cards[0].replace(" ", ""))  # Luhn-valid, same grouping
    assert cards[0] in o  # the same card gets the same surrogate in prompt and output
    ibans = re.findall(r"GB\d\d [A-Z]{4} \d{4} \d{4} \d{4} \d\d", p)
    assert len(ibans) == 1 and iban.is_valid(ibans[0])
    emails = re.findall(r"[\w.]+@[\w\-]+\.pl", p)
    assert len(emails) == 1 and re.fullmatch(r"[a-z]+\.[a-z]+@[a-z\-]+\.pl", emails[0]), emails
    # the same real name -> the same fake name, also the surname alone in the output
    name = re.search(r"I am (.+?), card", p).group(1)
    surname = re.search(r"Mr (.+?)\. The", o).group(1)
    assert p.count(name) == 2 and name.endswith(surname) and surname != name
    # re-tokenisation is exact: ids decode to the governed text; lineage has kind + offsets only
    tok = vocab.tokenizer
    assert tok.decode(c.record.prompt_token_ids) == p and tok.decode(c.record.output_token_ids) == o
    spans = c.provenance.replaced
    assert {s.entity for s in spans} >= {"PERSON", "CREDIT_CARD", "IBAN_CODE", "EMAIL_ADDRESS"}
    for s in spans:
        src, dst = (prompt, p) if s.where == "prompt" else (output, o)
        assert src[s.start : s.end] not in c.provenance.model_dump_json()  # never the value
        assert dst[s.new_start : s.new_end] != src[s.start : s.end]
    assert scrubber.scrub([rec.prompt_text, rec.output_text], groups=[0, 0])[0].text == p  # seeded
    assert scrubber.anonymize("Call Tomasz Wiśniewski on +48 601 234 567") != ""


def test_example_names_and_todo_markers_are_not_persons(scrubber):
    texts = [
        "def test_greet():\n    assert greet('Alice') == 'Hello, Alice'\n"
        "    assert greet('Bob') == 'Hello, Bob'",
        "# TODO: handle the empty list\n# FIXME: Eve and Mallory may tamper with the channel\nx = 1",
        "Alice sends Bob a message encrypted with Bob's public key; Eve listens.",
        'users = [{"name": "John", "age": 30}, {"name": "Jane", "age": 28}]',
    ]
    for t, r in zip(texts, scrubber.scrub(texts), strict=True):
        assert r.spans == [], (t, r.spans)


def test_pii_free_prompt_sets_altered_share(scrubber):
    """PII-free code altered <= 2%; math keeps its fictional names as surrogates, never placeholders."""
    prompts = load_prompts("train")
    code = [p.text for p in prompts["code"]][:3000]
    res = scrubber.scrub(code)
    altered = sum(1 for r in res if r.spans)
    print(f"code: {altered}/{len(code)} altered")
    assert altered / len(code) <= 0.02
    math = [p.text for p in prompts["math"]][:1000]
    res = scrubber.scrub(math)
    assert not any("<PERSON>" in r.text or any(s.replacement is None for s in r.spans) for r in res)
    assert sum(1 for r in res if r.unsure) == 0


def test_unsure_record_is_quarantined_without_text(tmp_path, vocab, scrubber):
    rng = random.Random(5)
    when = datetime(2026, 12, 1, tzinfo=UTC)
    # a bare 9-digit run with a valid BSN/11-proof checksum and no context word: the second pass cannot tell
    unsure = probe_record(vocab, "Reference 422901209 please.", "Noted.", when, rng)
    normal = probe_record(vocab, "What is 12 times 7?", "84.", when + timedelta(seconds=1), rng)
    bad_vocab = probe_record(
        vocab, "My name is Siddharth Venkataraman.", "Hello.", when + timedelta(seconds=2), rng
    )
    bad_vocab = bad_vocab.model_copy(update={"output_token_ids": [vocab.vocab_size + 5]})
    gov = Governor(GovernanceConfig(data_dir=tmp_path / "gov"), vocab, scrubber)
    msgs = [Message(topics.RAW, 0, i, None, r.to_bytes()) for i, r in enumerate([unsure, normal, bad_vocab])]
    out = gov.govern(msgs)
    q = {x.record_id: x for x in out.quarantined}
    assert set(q) == {unsure.record_id, bad_vocab.record_id}
    u = q[unsure.record_id]
    assert [r.code for r in u.reasons] == ["pii_unsure"]
    assert u.prompt_scrubbed is None and u.output_scrubbed is None and u.record is None
    assert u.tenant_id == unsure.tenant_id and u.prompt_sha256 and u.output_sha256
    assert "422901209" not in u.model_dump_json()
    v = q[bad_vocab.record_id]  # both layers passed: the auditor sees the scrubbed text, nothing else
    assert v.record is None and v.prompt_scrubbed and "Venkataraman" not in v.prompt_scrubbed
    assert v.tenant_id == bad_vocab.tenant_id and re.fullmatch(
        r"hmac-sha256:[\w\-]+:[0-9a-f]{64}", v.output_sha256
    )


def test_context_enhancement_is_back(scrubber):
    """A number Presidio only accepts next to its context word (the lemma-free speed-up lost it)."""
    text = "My passport number is 912803456, can I still travel?"
    no_context = PiiScrubber(context=False, second_pass=False, surrogates=False)
    with_context = PiiScrubber(second_pass=False, surrogates=False)
    assert not [s for s in no_context.scrub([text])[0].spans if s.entity == "US_PASSPORT"]
    assert [s for s in with_context.scrub([text])[0].spans if s.entity == "US_PASSPORT"]
