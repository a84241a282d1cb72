"""Governance: PII scrubbing (Presidio), GX validation, anomaly filters, buffer, lineage, crash safety.

Everything runs for real: Presidio with the offline spaCy model, a Great Expectations suite, Parquet
shards, SQLite lineage and — for the end-to-end and crash tests — a Tansu broker process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from adaflash.feedback import topics
from adaflash.feedback.schema import CleanRecord, QuarantineRecord
from adaflash.governance.filters import FilterConfig
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.pii_spans import Span, replace_spans
from adaflash.governance.retokenize import scrub_token_ids
from adaflash.governance.service import GovernanceService
from adaflash.governance.synthetic import ANOMALIES, TrafficGenerator
from adaflash.models.targets import load_vocabulary
from adaflash.workloads import load_prompts
from tests.kafka_util import produce, read_topic, running_broker

FILTERS = FilterConfig(flood_max_per_window=40, dup_max_similar=12)


@pytest.fixture(scope="module")
def base_prompts():
    # Short prompts keep the NER cost of thousands of records low; math + chat, which carry names.
    by = load_prompts("train")
    # (under 2,000 characters: a longer chat prompt exceeds the tiny byte tokenizer's length limit)
    return [p.text for p in by["math"][:1500]] + [p.text for p in by["chat"] if len(p.text) < 2000]


def _governor(tmp_path, vocab, scrubber, filters=FILTERS) -> Governor:
    return Governor(GovernanceConfig(data_dir=tmp_path / "gov", filters=filters), vocab, scrubber)


def _messages(items) -> list[Message]:
    return [Message(topics.RAW, 0, i, m.key, m.value) for i, m in enumerate(items)]


def _bpe_tokenizer():
    """A small byte-level BPE (the SmolLM2/GPT-2 kind) trained on the spot: merges span word parts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from adaflash.models.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [p for ps in load_prompts("train").values() for p in ps][:3000]
    tok.train_from_iterator(
        [p.text for p in corpus],
        trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_retokenize_rewrites_only_scrubbed_spans(kind, vocab):
    tok = vocab.tokenizer if kind == "bytes" else _bpe_tokenizer()
    text = "Dear Zoë Müller, card 4111 1111 1111 1111 is charged 😀 twice; call (415) 555-0134 today."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    spans = [Span(5, 15, "PERSON"), Span(22, 41, "CREDIT_CARD"), Span(67, 81, "PHONE_NUMBER")]
    assert text[5:15] == "Zoë Müller" and text[67:81] == "(415) 555-0134"
    out = scrub_token_ids(ids, text, spans, tok)
    assert tok.decode(out.token_ids) == replace_spans(text, spans)
    for old, new in enumerate(out.index_map):
        if new is not None:
            assert out.token_ids[new] == ids[old]  # untouched tokens keep their ids
    kept = [i for i, n in enumerate(out.index_map) if n is not None]
    assert len(kept) > len(ids) // 3
    # tokens that overlapped a span are gone, and no PII byte survives
    assert "Müller" not in tok.decode(out.token_ids) and "4111" not in tok.decode(out.token_ids)


def test_identical_garbage_is_quarantined_per_message_and_redelivery_is_a_duplicate(
    tmp_path, vocab, scrubber
):
    """Two producers sending the same unparseable bytes are two messages: both are quarantined
    (this used to crash the batch on the lineage store's unique record id); the same message
    delivered again after a restart is a duplicate."""
    gov = _governor(tmp_path, vocab, scrubber)
    junk = b"{not json: Summarise the attached report."
    msgs = [Message(topics.RAW, 0, 0, None, junk), Message(topics.RAW, 0, 1, None, junk)]
    out = gov.govern(msgs)
    gov.persist(out, datetime.now(UTC), None)
    assert len(out.quarantined) == 2 and out.n_duplicate == 0
    assert all(q.reasons[0].code == "schema" for q in out.quarantined)
    again = gov.govern([Message(topics.RAW, 0, 1, None, junk), Message(topics.RAW, 0, 2, None, junk)])
    gov.persist(again, datetime.now(UTC), None)
    assert again.n_duplicate == 1 and len(again.quarantined) == 1
    assert gov.lineage.totals()["quarantined"] == 3


@pytest.mark.parametrize("kind", [k for k in ANOMALIES if k not in ("flood", "near_duplicate")])
def test_record_anomaly_is_quarantined_with_its_reason(kind, tmp_path, vocab, scrubber, base_prompts):
    gen = TrafficGenerator(vocab, base_prompts, seed=ANOMALIES.index(kind))
    items = [gen.normal() for _ in range(20)] + [m for _ in range(4) for m in gen.anomaly(kind)]
    out = _governor(tmp_path, vocab, scrubber).govern(_messages(items))
    by_id = {q.record_id: q for q in out.quarantined}
    by_hash = {q.raw_sha256: q for q in out.quarantined if q.raw_sha256}
    for m in items:
        if m.planted.anomaly is None:
            assert m.planted.record_id in {c.record.record_id for c in out.clean}
            continue
        q = by_id.get(m.planted.record_id) or by_hash.get(hashlib.sha256(m.value).hexdigest())
        assert q is not None, f"planted {kind} record was not quarantined"
        assert kind in [r.code for r in q.reasons]
        if kind == "consent":
            assert q.record is None  # an opted-out tenant's text is not kept, even scrubbed
    assert out.n_in == len(out.clean) + len(out.quarantined)


def test_flood_and_near_duplicate_excess_is_quarantined(tmp_path, vocab, scrubber, base_prompts):
    gen = TrafficGenerator(vocab, base_prompts, seed=3)
    items = [gen.normal() for _ in range(30)] + gen.flood_burst(FILTERS, 9) + gen.poison_burst(FILTERS, 7)
    items += [gen.normal() for _ in range(30)]
    out = _governor(tmp_path, vocab, scrubber).govern(_messages(items))
    reasons = Counter(r.code for q in out.quarantined for r in q.reasons)
    assert reasons["flood"] == 9 and reasons["near_duplicate"] == 7
    assert len(out.quarantined) == 16
    planted_flood = {m.planted.record_id for m in items if m.planted.anomaly == "flood"}
    assert planted_flood == {q.record_id for q in out.quarantined if q.reasons[0].code == "flood"}


def test_filters_survive_restart(tmp_path, vocab, scrubber, base_prompts):
    """The flood window is rebuilt from the lineage store: a restart does not reset a tenant's count."""
    gen = TrafficGenerator(vocab, base_prompts, seed=4)
    burst = gen.flood_burst(FILTERS, 10)
    gov = _governor(tmp_path, vocab, scrubber)
    first = gov.govern(_messages(burst[:30]))
    gov.persist(first, datetime.now(UTC), None)
    gov.lineage.close()
    again = _governor(tmp_path, vocab, scrubber).govern(
        [Message(topics.RAW, 0, 30 + i, m.key, m.value) for i, m in enumerate(burst[30:])]
    )
    assert sum(1 for q in again.quarantined if q.reasons[0].code == "flood") == 10


def test_orphan_shard_from_interrupted_batch_is_removed(tmp_path, vocab, scrubber, base_prompts):
    gen = TrafficGenerator(vocab, base_prompts, seed=5)
    msgs = _messages([gen.normal() for _ in range(10)])
    gov = _governor(tmp_path, vocab, scrubber)
    out = gov.govern(msgs)
    # A crash after the shard's rename but before the lineage commit leaves an unlisted shard.
    gov.buffer.write_shard("tenant-00", "2026-11-30", out.clean)
    gov.lineage.close()
    gov2 = _governor(tmp_path, vocab, scrubber)
    assert gov2.buffer.shard_files() == []
    out2 = gov2.govern(msgs)  # redelivered: governed again, not duplicates
    assert out2.n_duplicate == 0 and len(out2.clean) == 10
    gov2.persist(out2, datetime.now(UTC), None)
    assert out2.n_in == 10
    assert gov2.govern(msgs).n_duplicate == 10  # once committed, a redelivery is a no-op


def _grep_targets(data_dir: Path, bootstrap: str) -> dict[str, str]:
    """Every place governance output rests, as text."""
    import pyarrow.parquet as pq

    from adaflash.governance.buffer import ReplayBuffer

    buffer = ReplayBuffer(data_dir / "buffer")
    shards = "\n".join(
        json.dumps(pq.read_table(p).to_pylist(), default=str, ensure_ascii=False)
        for p in buffer.shard_files()
    )
    db = sqlite3.connect(data_dir / "lineage.sqlite")
    dump = "\n".join(db.iterdump())
    db.close()
    files = "\n".join(
        p.read_bytes().decode("utf-8", "replace")
        for p in data_dir.rglob("*")
        if p.is_file() and p.suffix != ".parquet"
    )
    return {
        "replay buffer": shards,
        "lineage store + audit": dump,
        "other files": files,
        "clean topic": "\n".join(m.value.decode() for m in read_topic(bootstrap, topics.CLEAN)),
        "quarantine topic": "\n".join(m.value.decode() for m in read_topic(bootstrap, topics.QUARANTINE)),
    }


def test_end_to_end_conservation_pii_and_trainability(
    tmp_path, vocab, scrubber, base_prompts, caplog, capsys
):
    """5,000 records through the real broker: ≥10% planted anomalies of every kind, half with PII."""
    caplog.set_level(logging.DEBUG, logger="adaflash")
    gen = TrafficGenerator(vocab, base_prompts, seed=11, seconds_per_record=1.0)
    items = []
    kinds = [k for k in ANOMALIES if k not in ("flood", "near_duplicate")]
    while len(items) < 5000:
        r = gen.rng.random()
        if r < 0.13:
            items += gen.anomaly(gen.rng.choice(kinds))
        elif r < 0.135:
            items += gen.flood_burst(FILTERS, 8)
        elif r < 0.14:
            items += gen.poison_burst(FILTERS, 8)
        else:
            items.append(gen.normal(pii_fraction=0.5))
    planted = Counter(m.planted.anomaly for m in items if m.planted.anomaly)
    assert set(planted) == set(ANOMALIES) and sum(planted.values()) >= 0.1 * len(items)
    canaries = [(e, v) for m in items for e, v in m.planted.canaries]
    assert len({m.planted.record_id for m in items if m.planted.canaries}) >= 1000

    with running_broker(tmp_path / "broker") as broker:
        produce(broker.bootstrap_servers, topics.RAW, [(m.key, m.value) for m in items])
        cfg = GovernanceConfig(
            data_dir=tmp_path / "gov",
            bootstrap_servers=broker.bootstrap_servers,
            batch_size=500,
            filters=FILTERS,
        )
        svc = GovernanceService(cfg, Governor(cfg, vocab, scrubber))
        audits = []
        svc.run(idle_exit_s=8, on_batch=audits.append)
        svc.close()
        at_rest = _grep_targets(cfg.data_dir, broker.bootstrap_servers)
        clean_msgs = [
            CleanRecord.model_validate_json(m.value)
            for m in read_topic(broker.bootstrap_servers, topics.CLEAN)
        ]
        quar_msgs = [
            QuarantineRecord.model_validate_json(m.value)
            for m in read_topic(broker.bootstrap_servers, topics.QUARANTINE)
        ]
    at_rest["logs"] = caplog.text + capsys.readouterr().out

    # Conservation, per batch and overall.
    assert audits and all(a.n_in == a.n_clean + a.n_quarantined + a.n_duplicate for a in audits)
    assert sum(a.n_in for a in audits) == len(items)
    assert len(clean_msgs) + len(quar_msgs) == len(items)

    # Every planted anomaly is quarantined with its reason; nothing normal is (flood/near-dup: by count).
    by_id = {q.record_id: q for q in quar_msgs}
    by_hash = {q.raw_sha256: q for q in quar_msgs if q.raw_sha256}
    quarantined_reasons = Counter()
    for m in items:
        q = by_id.get(m.planted.record_id) or by_hash.get(hashlib.sha256(m.value).hexdigest())
        if m.planted.anomaly in (None, "flood", "near_duplicate"):
            continue
        assert q is not None and m.planted.anomaly in [r.code for r in q.reasons], m.planted
    for q in quar_msgs:
        quarantined_reasons.update({r.code for r in q.reasons})
    assert quarantined_reasons["flood"] == planted["flood"]
    assert quarantined_reasons["near_duplicate"] == planted["near_duplicate"]
    assert len(quar_msgs) == sum(planted.values())

    # No canary string anywhere at rest: buffer, topics, lineage/audit, files, logs.
    leaks = [(where, e, v) for e, v in canaries for where, text in at_rest.items() if v in text]
    assert not leaks, f"{len(leaks)} canaries leaked, e.g. {leaks[:5]}"
    assert sum(sum(a.pii_entities.values()) for a in audits) >= len(canaries)

    # Clean records stay trainable: valid ids, text = decode(ids), rounds inside the sequence.
    assert len(clean_msgs) > 3000
    tok = vocab.tokenizer
    n_scrubbed = 0
    for c in clean_msgs:
        r = c.record
        n_scrubbed += c.provenance.scrubbed
        ids = r.prompt_token_ids + r.output_token_ids
        assert ids and max(ids) < vocab.vocab_size and min(ids) >= 0
        assert (
            tok.decode(r.output_token_ids) == r.output_text
            and tok.decode(r.prompt_token_ids) == r.prompt_text
        )
        for rd in r.rounds:
            assert 0 <= rd.start and rd.start + rd.accepted + 1 <= len(r.output_token_ids)
            assert rd.accepted <= rd.verify_len - 1
    assert n_scrubbed > 500
    _fast_learner_holds_its_caps_and_no_pii(clean_msgs, canaries, tok)


def _fast_learner_holds_its_caps_and_no_pii(clean_msgs, canaries, tok) -> None:
    """The suffix cache fed by this clean topic (as `serve`'s feed is, record by record): within
    its caps in tokens and in memory measured by tracemalloc, and none of the planted PII in the
    responses it holds, read back and decoded."""
    import tracemalloc

    from adaflash.serving.suffix_cache import BYTES_PER_TOKEN, SuffixCache, SuffixCacheConfig
    from adaflash.serving.suffix_feed import CleanFeed

    total = sum(len(c.record.output_token_ids) for c in clean_msgs)
    cfg = SuffixCacheConfig(max_tokens=total // 3, max_tokens_per_tenant=total // 8)
    tracemalloc.start()
    try:
        cache = SuffixCache(cfg)
        feed = CleanFeed(cache, "", None)
        for i, c in enumerate(clean_msgs):
            feed.apply(c.model_dump_json().encode(), f"{topics.CLEAN}/0", i)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    st = cache.stats()
    assert st.evicted > 0 and st.added > st.evicted  # the caps were reached, and it kept learning
    per_tenant = {t: sum(map(len, cache.contents(t))) for t in cache.tenants()}
    assert st.tokens == sum(per_tenant.values()) <= cfg.max_tokens
    assert max(per_tenant.values()) <= cfg.max_tokens_per_tenant
    assert st.bytes == st.tokens * BYTES_PER_TOKEN and held <= 1.5 * cfg.max_tokens * BYTES_PER_TOKEN, held
    texts = "\n".join(tok.decode(ids) for t in cache.tenants() for ids in cache.contents(t))
    leaks = [v for _, v in canaries if v in texts]
    assert not leaks, f"{len(leaks)} planted values in the suffix cache, e.g. {leaks[:3]}"


def test_lineage_cli_answers_for_records_shards_tenants(tmp_path, vocab, scrubber, base_prompts):
    from typer.testing import CliRunner

    from adaflash.cli import app

    gen = TrafficGenerator(vocab, base_prompts, seed=8)
    items = [gen.normal() for _ in range(30)] + gen.anomaly("vocab")
    gov = _governor(tmp_path, vocab, scrubber)
    gov.persist(gov.govern(_messages(items)), datetime.now(UTC), None)
    shard = gov.lineage.shards()[0]
    rid = next(m.planted.record_id for m in items if m.planted.tenant_id == shard["tenant_id"])
    gov.lineage.mark_trained([shard["shard_id"]], "7", "2026-11-30T10:00:00", record_ids=[rid])
    assert gov.lineage.records_for_version("7") == [rid]
    assert gov.lineage.untrained_shards() and shard["shard_id"] not in {
        s["shard_id"] for s in gov.lineage.untrained_shards()
    }
    gov.lineage.close()
    d = str(tmp_path / "gov")
    runner = CliRunner()
    bad = items[-1].planted.record_id
    res = runner.invoke(app, ["lineage", "record", bad, "--data-dir", d])
    assert res.exit_code == 0 and '"quarantined"' in res.output and "vocab" in res.output
    res = runner.invoke(app, ["lineage", "record", rid, "--data-dir", d])
    assert '"clean"' in res.output and shard["shard_id"] in res.output and '"7"' in res.output
    res = runner.invoke(app, ["lineage", "shard", shard["shard_id"], "--data-dir", d])
    assert res.exit_code == 0 and shard["tenant_id"] in res.output
    tenant = items[-1].planted.tenant_id
    res = runner.invoke(app, ["lineage", "tenant", tenant, "--data-dir", d])
    assert res.exit_code == 0 and '"vocab": 1' in res.output
    res = runner.invoke(app, ["lineage", "audit", "--data-dir", d])
    assert res.exit_code == 0 and "31" in res.output


def test_sigkill_mid_batch_loses_and_duplicates_nothing(tmp_path, vocab, base_prompts):
    gen = TrafficGenerator(vocab, base_prompts, seed=21)
    items = [gen.normal(pii_fraction=0.5) for _ in range(900)]
    data_dir = tmp_path / "gov"
    env = {**os.environ, "ADAFLASH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with running_broker(tmp_path / "broker") as broker:
        produce(broker.bootstrap_servers, topics.RAW, [(m.key, m.value) for m in items])
        cmd = [
            sys.executable, "-m", "adaflash.cli", "governance", "run", "--target", "tiny",
            "--bootstrap-servers", broker.bootstrap_servers, "--data-dir", str(data_dir),
            "--batch-size", "100", "--idle-exit", "6",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600  # a hang guard; two batches take ~40 s alone, minutes under load
        batches = 0
        while batches < 2:  # let two batches commit, then kill inside the third
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "governance exited early"
            batches += line.startswith("batch ")
            assert time.monotonic() < deadline
        time.sleep(0.7)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        from adaflash.governance.lineage import LineageStore

        killed = LineageStore(data_dir / "lineage.sqlite")
        assert killed.totals()["batches"] == 2  # the third batch was in flight: killed mid-batch
        killed.close()
        rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    from adaflash.governance.buffer import ReplayBuffer

    ids = [c.record.record_id for c in ReplayBuffer(data_dir / "buffer").records()]
    assert len(ids) == len(set(ids)) == len(items)  # nothing lost, nothing twice
    assert set(ids) == {m.planted.record_id for m in items}
    store = LineageStore(data_dir / "lineage.sqlite")
    totals = store.totals()
    assert totals["clean"] == len(items)  # each record governed into the store exactly once
    assert totals["in"] == totals["clean"] + totals["quarantined"] + totals["duplicate"]


@pytest.mark.smollm2
def test_scrubbed_records_stay_trainable_for_smollm2(tmp_path, scrubber, base_prompts):
    """The real target's byte-level BPE: scrubbed ids decode to the scrubbed text, rounds stay inside."""
    vocab = load_vocabulary("smollm2")
    gen = TrafficGenerator(vocab, base_prompts, seed=31, min_output_chars=300)
    items = [gen.normal(pii_fraction=1.0) for _ in range(150)]
    out = _governor(tmp_path, vocab, scrubber).govern(_messages(items))
    assert len(out.clean) == len(items)
    blob = "\n".join(c.model_dump_json() for c in out.clean)
    assert not [v for m in items for _, v in m.planted.canaries if v in blob]
    tok = vocab.tokenizer
    kept = total = 0
    for c in out.clean:
        r = c.record
        assert max(r.prompt_token_ids + r.output_token_ids) < vocab.vocab_size
        assert (
            tok.decode(r.prompt_token_ids) == r.prompt_text
            and tok.decode(r.output_token_ids) == r.output_text
        )
        for rd in r.rounds:
            assert rd.start + rd.accepted + 1 <= len(r.output_token_ids)
        kept += len(r.rounds)
    total = sum(len(json.loads(m.value)["rounds"]) for m in items)
    assert kept > 0.6 * total  # only rounds touching a scrubbed span are dropped


def test_a_full_disk_is_a_fault_governance_survives(tmp_path, vocab, scrubber, base_prompts, monkeypatch):
    """Issue 32: ENOSPC on a shard or the lineage store ended `governance run`. Now the service
    backs off with the batch it governed, commits no offset for output it could not write, counts
    the fault, and persists that same batch once space returns (no record governed twice)."""
    import errno

    from adaflash.governance.buffer import ReplayBuffer
    from adaflash.governance.lineage import LineageStore

    faults = ["shard", "shard", "lineage"]  # the disk is full for three writes, then space returns
    real_write, real_commit = ReplayBuffer.write_shard, LineageStore.commit_batch

    def write_shard(self, *a, **kw):
        if faults and faults[0] == "shard":
            faults.pop(0)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *a, **kw)

    def commit_batch(self, *a, **kw):
        if faults and faults[0] == "lineage":
            faults.pop(0)
            raise sqlite3.OperationalError("database or disk is full")
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(ReplayBuffer, "write_shard", write_shard)
    monkeypatch.setattr(LineageStore, "commit_batch", commit_batch)
    gen = TrafficGenerator(vocab, base_prompts, seed=31)
    items = [gen.normal(pii_fraction=0.3) for _ in range(40)]
    with running_broker(tmp_path / "broker") as broker:
        produce(broker.bootstrap_servers, topics.RAW, [(m.key, m.value) for m in items])
        cfg = GovernanceConfig(data_dir=tmp_path / "gov", bootstrap_servers=broker.bootstrap_servers,
                               batch_size=100, filters=FILTERS)  # fmt: skip
        svc = GovernanceService(cfg, Governor(cfg, vocab, scrubber))
        audits = []
        svc.run(idle_exit_s=6, on_batch=audits.append)  # used to raise OSError / OperationalError
        assert not faults and svc.disk_full_errors == 3
        from kafka import TopicPartition

        parts = svc.consumer.assignment() or {TopicPartition(topics.RAW, p) for p in range(4)}
        committed = sum(svc.consumer.committed(tp) or 0 for tp in parts)
        svc.close()
    assert committed == len(items)  # every offset committed once its output was durable
    assert sum(a.n_in for a in audits) == len(items) and sum(a.n_duplicate for a in audits) == 0
    ids = [c.record.record_id for c in ReplayBuffer(cfg.buffer_dir).records()]
    assert sorted(ids) == sorted(m.planted.record_id for m in items)  # each record once, none lost
