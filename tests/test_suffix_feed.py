"""The suffix cache is fed by governance, never by raw traffic: records with planted PII go through a
real Tansu broker and `GovernanceService` (Presidio, Great Expectations), the serving side's
`CleanFeed` reads `adaflash.feedback.clean`, and the cache's contents are read back."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta

from adaflash.bench.pii_quality import probe_record
from adaflash.feedback import topics
from adaflash.feedback.schema import CleanRecord
from adaflash.governance.governor import GovernanceConfig, Governor
from adaflash.governance.service import GovernanceService
from adaflash.serving.suffix_cache import SuffixCache, SuffixCacheConfig
from adaflash.serving.suffix_feed import CleanFeed
from tests.conftest import clean_record
from tests.kafka_util import produce, read_topic, running_broker
from tests.pii_canaries import TUNING
from tests.test_governance_pii import FILLER, _leaks

TOOL = 'get_weather(city="{city}", unit="celsius")\nThe forecast for {city} is mild.'


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_cache_learns_only_governed_consented_responses_without_pii(tmp_path, vocab, scrubber):
    rng = random.Random(0)
    t0 = datetime.now(UTC) - timedelta(minutes=10)
    canaries = TUNING[:24]
    records = []
    for i, c in enumerate(canaries):  # PII planted in the answer: what the cache would learn
        out = f"{FILLER[i % 3]}\n{c.text}\n{TOOL.format(city=['Oslo', 'Lima', 'Pune'][i % 3])}"
        records.append(probe_record(vocab, "Please answer.", out, t0 + timedelta(seconds=7 * i), rng))
    opted_out = probe_record(vocab, "Q", "opted out answer: " + TOOL.format(city="Quito"), t0, rng)
    opted_out.consent = False
    broken = probe_record(vocab, "Q", "quarantined answer: " + TOOL.format(city="Cairo"), t0, rng)
    broken.output_token_ids = [*broken.output_token_ids, 10**6]  # out of the vocabulary
    records += [opted_out, broken]
    with running_broker(tmp_path / "broker") as broker:
        cache = SuffixCache(SuffixCacheConfig())
        feed = CleanFeed(cache, broker.bootstrap_servers, vocab.fingerprint).start()
        produce(broker.bootstrap_servers, topics.RAW, [(r.tenant_id.encode(), r.to_bytes()) for r in records])
        cfg = GovernanceConfig(
            data_dir=tmp_path / "gov", bootstrap_servers=broker.bootstrap_servers, batch_size=100
        )
        svc = GovernanceService(cfg, Governor(cfg, vocab, scrubber))
        t_governed = time.monotonic()
        svc.run(idle_exit_s=8)
        svc.close()
        clean = [
            CleanRecord.model_validate_json(m.value)
            for m in read_topic(broker.bootstrap_servers, topics.CLEAN)
        ]
        learnable = [c.record for c in clean if c.record.consent]
        _wait(lambda: cache.stats().added == len(learnable), 30, "the feed did not apply every clean record")
        print(f"governed + learned within {time.monotonic() - t_governed:.1f} s")
        feed.stop()
        # A restarted server rebuilds the same cache from the clean topic.
        again = SuffixCache(SuffixCacheConfig())
        feed2 = CleanFeed(again, broker.bootstrap_servers, vocab.fingerprint).start()
        _wait(lambda: again.stats().added == len(learnable), 30, "a restart did not rebuild the cache")
        feed2.stop()
    assert len(learnable) >= len(canaries) - 2  # governance kept (scrubbed) the PII records
    tok = vocab.tokenizer
    held = {t: [tok.decode(ids) for ids in cache.contents(t)] for t in cache.tenants()}
    texts = "\n".join(x for v in held.values() for x in v)
    leaks = [(c.kind, _leaks(c, texts)) for c in canaries if _leaks(c, texts)]
    assert not leaks
    assert "Quito" not in texts and "Cairo" not in texts  # opted out / quarantined: never learned
    assert sorted(held) == sorted({r.tenant_id for r in learnable})
    for r in learnable:  # each tenant holds exactly its own governed answers
        assert r.output_token_ids in cache.contents(r.tenant_id)
    assert sum(len(v) for v in held.values()) == len(learnable)
    assert sorted(again.contents(learnable[0].tenant_id)) == sorted(cache.contents(learnable[0].tenant_id))
    assert cache.stats().last_offsets  # /health shows where the feed is


def test_feed_skips_other_targets_and_unparseable_messages(vocab):
    rng = random.Random(1)
    cache = SuffixCache()
    feed = CleanFeed(cache, "127.0.0.1:1", vocab.fingerprint)
    rec = probe_record(vocab, "Q", "an answer long enough to learn from", datetime.now(UTC), rng)
    other = rec.model_copy(update={"target_fingerprint": "another-target", "record_id": "x"})
    assert not feed.apply(clean_record(other, topic=topics.RAW).model_dump_json().encode(), "c/0", 0)
    assert not feed.apply(b"{not json", "c/0", 1)
    assert feed.apply(clean_record(rec, topic=topics.RAW).model_dump_json().encode(), "c/0", 2)
    assert cache.stats().skipped == {"target": 1, "invalid": 1} and cache.stats().last_offsets == {"c/0": 2}
