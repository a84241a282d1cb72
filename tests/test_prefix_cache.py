"""Prefix reuse (`serving/prefix_cache.py`): a request whose prompt starts like an earlier one of
its tenant prefills only the rest, every method stays token-identical to the target alone (and
sampling draws the same tokens from the same seed), tenants never see each other's blocks, a
request without consent keeps nothing, and the caps hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.prefix_cache import PrefixCache, PrefixCacheConfig
from tests.conftest import ar_reference, make_bundle

HEAD = [256, *b"system: the tools are lookup(city), convert(amount, unit), plan(route). Use one.\n"]
PROMPTS = [HEAD + list(f"user {i}: {'why ' * (i % 3)}{i * 13}?".encode()) for i in range(6)]
BLOCK = 16


def _engine(target, bundle=None, method="ar", **cache) -> Engine:
    cfg = EngineConfig(method=method, calibrate=False, prefix=PrefixCacheConfig(block_tokens=BLOCK, **cache))
    return Engine(target, bundle, cfg, "v1" if bundle is not None else None)


def _serve_one(
    engine: Engine, prompt, tenant="t1", temperature=0.0, seed=None, **flags
) -> tuple[Request, int]:
    """Serve one request alone; returns it and the prefill rows its admission step computed.
    The slots' K/V are zeroed first: requests served one by one would reuse slot 0, whose stale
    K/V of the last prompt would hide a head that was not copied in."""
    for t in [engine.runner.cache.k, engine.runner.cache.v]:
        t.zero_()
    if engine.policy.drafter.dslots is not None:
        engine.policy.drafter.dslots.flush()
        for t in engine.policy.drafter.dslots.k + engine.policy.drafter.dslots.v:
            t.zero_()
    params = GenParams(max_tokens=24, temperature=temperature, seed=seed)
    req = Request(list(prompt), params, tenant_id=tenant, **flags)
    engine.submit(req)
    first = engine.step()
    while engine.step() is not None:
        pass
    return req, first.prefill_tokens


@pytest.fixture(scope="module")
def bundle(tiny):
    return make_bundle(tiny, block_size=8, seed=3)


@pytest.fixture(scope="module")
def reference(tiny):
    return ar_reference(tiny, PROMPTS, 24)


@pytest.mark.parametrize("method", ["ar", "dflash", "adaflash", "adaflash-cost", "ngram", "suffix"])
def test_reused_heads_prefill_only_the_rest_and_change_no_token(tiny, bundle, reference, method):
    engine = _engine(tiny, bundle, method)
    full_blocks = (len(HEAD) // BLOCK) * BLOCK
    prefills = []
    for i, p in enumerate(PROMPTS):
        req, rows = _serve_one(engine, p)
        assert req.output_ids == reference[i], f"prompt {i} differs from the target alone"
        prefills.append(rows)
    assert prefills[0] == len(PROMPTS[0])  # a cold cache
    for p, rows in zip(PROMPTS[1:], prefills[1:], strict=True):
        assert rows <= len(p) - full_blocks, "the shared head was prefilled again"
    stats = engine.prefix_cache.stats()
    assert stats["hits"] >= len(PROMPTS) - 1 and stats["reused_tokens"] >= full_blocks * (len(PROMPTS) - 1)


def test_a_drafter_request_does_not_reuse_blocks_cached_without_its_features(tiny, bundle, reference):
    """Blocks cached before any drafter was installed hold no target features: a drafter request
    cannot build its context from them, prefills them, and leaves them with features."""
    engine = _engine(tiny, None, "ar")
    _serve_one(engine, PROMPTS[0])
    engine.stage_drafter(bundle, "v2")
    assert engine.step() is None and engine.drafter_version == "v2"  # hot reload, between steps
    engine.config.method = "adaflash"
    first, rows = _serve_one(engine, PROMPTS[1])
    second, rows2 = _serve_one(engine, PROMPTS[2])
    assert rows == len(PROMPTS[1]) and rows2 < len(PROMPTS[2])
    assert first.output_ids == reference[1] and second.output_ids == reference[2]


def test_an_ar_request_leaves_heads_a_drafter_request_can_reuse(tiny, bundle, reference):
    """With a drafter installed, an `ar` prefill captures the features too."""
    engine = _engine(tiny, bundle, "ar")
    _serve_one(engine, PROMPTS[0])
    engine.config.method = "adaflash-cost"
    req, rows = _serve_one(engine, PROMPTS[1])
    assert rows < len(PROMPTS[1]) and req.output_ids == reference[1]


def test_the_drafter_sees_the_same_context_through_a_reused_head(tiny, bundle):
    """The head's cached target features reach the drafter's context: after a request with a
    reused head, its slot's drafter K/V equal those a full prefill builds, bit for bit."""
    contexts = {}
    for enabled in (True, False):
        engine = _engine(tiny, bundle, "dflash", enabled=enabled)
        _serve_one(engine, PROMPTS[0])
        req, _ = _serve_one(engine, PROMPTS[4])
        slots = engine.policy.drafter.dslots
        slots.flush()
        n = req.kv_len
        contexts[enabled] = [(k[req.slot, :, :n].clone(), v[req.slot, :, :n].clone())
                             for k, v in zip(slots.k, slots.v, strict=True)]  # fmt: skip
    for (k1, v1), (k0, v0) in zip(contexts[True], contexts[False], strict=True):
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_sampling_draws_the_same_tokens_with_a_reused_head(tiny, bundle):
    """The reused K/V are bit-identical to a prefill's, so a seeded sampled request is too."""
    outs = {}
    for enabled in (True, False):
        engine = _engine(tiny, bundle, "adaflash", enabled=enabled)
        _serve_one(engine, PROMPTS[0], temperature=0.9, seed=1)
        req, rows = _serve_one(engine, PROMPTS[3], temperature=0.9, seed=7)
        outs[enabled] = (req.output_ids, rows)
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] < outs[False][1] == len(PROMPTS[3])


def test_a_tenant_never_reuses_another_tenants_prompts_unless_shared_is_opted_in(tiny):
    engine = _engine(tiny)
    _serve_one(engine, PROMPTS[0], tenant="acme")
    _, rows = _serve_one(engine, PROMPTS[1], tenant="globex")
    assert rows == len(PROMPTS[1]) and engine.prefix_cache.stats()["hits"] == 0
    shared = _engine(tiny, cross_tenant=True)
    _serve_one(shared, PROMPTS[0], tenant="acme")
    _, rows = _serve_one(shared, PROMPTS[1], tenant="globex")
    assert rows < len(PROMPTS[1])


def test_no_consent_or_opt_out_keeps_nothing(tiny):
    engine = _engine(tiny)
    _serve_one(engine, PROMPTS[0], consent=False)
    assert engine.prefix_cache.stats()["blocks"] == 0
    _serve_one(engine, PROMPTS[0])
    _, rows = _serve_one(engine, PROMPTS[1], use_prefix_cache=False)
    assert rows == len(PROMPTS[1])
    _, rows = _serve_one(engine, PROMPTS[1], consent=False)  # reads its tenant's blocks
    assert rows < len(PROMPTS[1])


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 1, n, 4), torch.randn(2, 1, n, 4)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=25),
    tenants=st.lists(st.sampled_from(["a", "b", "c"]), min_size=25, max_size=25),
)
def test_the_cache_stays_in_its_caps_and_only_returns_true_prefixes(prompts, tenants):
    block_bytes = 2 * 2 * 1 * 4 * 4 * 4  # k and v of one 4-token block
    cfg = PrefixCacheConfig(
        block_tokens=4, max_mb=12 * block_bytes / 2**20, max_mb_per_tenant=5 * block_bytes / 2**20
    )
    cache = PrefixCache(cfg)
    for p, t in zip(prompts, tenants, strict=False):
        chain = cache.match(t, p, None)
        n = 4 * len(chain)
        assert n <= len(p) - 1
        assert [tok for b in chain for tok in b.tokens] == p[:n]
        assert all(b.scope == t for b in chain)
        k, v = _kv(len(p))
        cache.insert(t, p, k, v, None, (), n)
        s = cache.stats()
        assert s["bytes"] <= 12 * block_bytes
        assert all(n <= 5 * block_bytes for n in cache._bytes.values())
        assert s["bytes"] == sum(b.nbytes for b in cache._blocks.values())
        # every cached block is reachable from its root: eviction took whole subtrees
        for b in cache._blocks.values():
            assert b.parent == -1 or b.parent in cache._blocks


def test_snapshot_restores_the_contents_the_bench_times_from():
    cache = PrefixCache(PrefixCacheConfig(block_tokens=4))
    p = list(range(13))
    k, v = _kv(13)
    cache.insert("a", p, k, v, None, (), 0)
    snap = cache.snapshot()
    q = [9, 9, 9, 9, 9, 9, 9, 9, 9]
    cache.insert("a", q, *_kv(9), None, (), 0)
    assert len(cache.match("a", q, None)) == 2
    cache.restore(snap)
    assert cache.match("a", q, None) == [] and len(cache.match("a", p, None)) == 3


def test_the_server_reuses_a_tenants_head_and_reports_it(tiny):
    """Through HTTP: the second request of a tenant with the same system prompt reuses its head,
    `X-Prefix-Cache: off` does not, and `/health` and `/metrics` show the cache."""
    import httpx

    from tests.test_server import serving

    system = "You are a tool router. Tools: lookup(city), convert(amount, unit), plan(route). " * 2
    with serving(tiny, None, method="ar", prefix=PrefixCacheConfig(block_tokens=BLOCK)) as (engine, srv):
        outs = []
        for i, headers in enumerate([{}, {}, {"X-Prefix-Cache": "off"}]):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]
            body = {"model": "adaflash", "max_tokens": 8, "temperature": 0, "messages": messages}
            r = httpx.post(
                srv.url + "/v1/chat/completions", json=body, headers={"X-Tenant-Id": "acme", **headers}
            )
            assert r.status_code == 200
            outs.append(engine.prefix_cache.stats()["reused_tokens"])
        health = httpx.get(srv.url + "/health").json()["prefix_cache"]
        metrics = httpx.get(srv.url + "/metrics").text
    assert outs[0] == 0 and outs[1] >= BLOCK * (len(system) // BLOCK - 1) and outs[2] == outs[1]
    assert health["hits"] == 1 and health["tenants"] == 1 and health["bytes"] > 0
    assert 'adaflash_prefix_cache{what="blocks"}' in metrics
    assert 'adaflash_prefix_cache_events_total{what="hits"} 1.0' in metrics


def test_a_reused_heads_features_wait_for_a_draft_without_counting(bundle):
    """Features queued from cache blocks are held by the cache anyway: they do not count toward
    the drafter context's flush bound (a request that never drafts never projects its head),
    and when they are projected the context is the same as from counted rows."""
    from adaflash.serving.runner import DrafterSlots

    width = bundle.drafter.fc.weight.shape[1]
    feats, slot_rows, positions = torch.randn(40, width), torch.full((40,), 1), torch.arange(40)
    shared, counted = (DrafterSlots(bundle.drafter, 2, 64, flush_bytes=1) for _ in range(2))
    shared.extend(feats, slot_rows, positions, shared=True)
    counted.extend(feats, slot_rows, positions)
    assert shared.queued_rows == 40 and counted.queued_rows == 0  # the counted rows flushed at once
    shared.flush()
    for a, b in zip(shared.k + shared.v, counted.k + counted.v, strict=True):
        assert torch.equal(a, b)


def test_a_tenant_whose_blocks_are_all_evicted_leaves_nothing_behind():
    """Tenant ids come from clients: one whose last block is evicted must not stay a key of the
    cache's byte counts (a client sending a new id per request would grow them without end)."""
    block_bytes = 2 * 2 * 1 * 4 * 4 * 4  # k and v of one 4-token block
    cache = PrefixCache(PrefixCacheConfig(block_tokens=4, max_mb=2 * block_bytes / 2**20))
    p = list(range(9))
    for i in range(50):
        cache.insert(f"tenant-{i}", p, *_kv(9), None, (), 0)
    holding = {b.scope for b in cache._blocks.values()}
    assert set(cache._bytes) == holding and len(holding) <= 2
    assert cache.stats()["tenants"] == len(holding)
