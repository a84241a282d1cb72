"""The fast learner: the suffix index (SuffixDecoding's proposal), the per-tenant cache and the
`suffix` proposer on the serving engine — lossless, tenant-isolated, bounded."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.models.suffix import SuffixConfig, SuffixIndex
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.suffix_cache import SuffixCache, SuffixCacheConfig
from tests.conftest import ar_reference, make_bundle
from tests.test_speculative import _chi2_pvalue, _exact_law, _tiny_vocab_target

EXACT = SuffixConfig(key=2, max_depth=6, min_prob=0.0, scan=10**9)


def _brute(seqs: list[list[int]], context: list[int], limit: int, c: SuffixConfig):
    """The documented proposal by brute force over every position (no index): occurrences of the
    context's newest tokens that have a continuation, the longest backward matches (≥ key, ≤
    max_depth), then the most frequent continuation while its share stays ≥ min_prob. Returns
    (match, [(set of argmax tokens, prob) per position])."""
    depth = min(c.max_depth, len(context))
    occ = []
    for s in seqs:
        for pos in range(c.key, len(s)):  # the continuation starts at pos
            m = 0
            while m < depth and pos - 1 - m >= 0 and s[pos - 1 - m] == context[-1 - m]:
                m += 1
            if m >= c.key:
                occ.append((m, s, pos))
    if not occ:
        return None
    match = max(m for m, *_ in occ)
    group = [(s, pos) for m, s, pos in occ if m == match]
    steps, p = [], 1.0
    for j in range(min(limit, int(c.spec_factor * match) + c.spec_offset)):
        nxt = Counter(s[pos + j] for s, pos in group if pos + j < len(s))
        if not nxt:
            break
        top = max(nxt.values())
        p *= top / len(group)
        if p < c.min_prob:
            break
        best = {t for t, n in nxt.items() if n == top}
        steps.append((best, p))
        if len(best) > 1:  # a tie: the index may follow either; compare up to here
            break
        group = [(s, pos) for s, pos in group if pos + j < len(s) and s[pos + j] in best]
    return match, steps


@settings(max_examples=200, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=5),
    context=st.lists(st.integers(0, 3), min_size=0, max_size=12),
    limit=st.integers(1, 8),
    removed=st.sets(st.integers(0, 4), max_size=3),
)
def test_index_proposes_what_the_brute_force_definition_does(seqs, context, limit, removed):
    idx = SuffixIndex(EXACT)
    for i, s in enumerate(seqs):
        half = len(s) // 2  # grown in two pieces, like a request's own index
        idx.extend(i, s[:half])
        idx.extend(i, s[half:])
    for i in removed:
        idx.remove(i)
    idx.compact()
    live = [s for i, s in enumerate(seqs) if i not in removed]
    want = _brute(live, context, limit, EXACT)
    got = idx.propose(context, limit)
    if want is None or not want[1]:
        assert got is None
        return
    match, steps = want
    assert got is not None and got.match == match
    for j, (tokens, p) in enumerate(steps):
        assert got.tokens[j] in tokens and abs(got.probs[j] - p) < 1e-9


def test_frequency_decides_and_draft_length_follows_the_match():
    idx = SuffixIndex(SuffixConfig(key=2, min_prob=0.3))
    for i in range(3):
        idx.add(i, [5, 6, 7, 1, 2, 3, 4])  # the common continuation
    idx.add(9, [5, 6, 7, 9, 9, 9, 9])  # the rare one (and the newest)
    d = idx.propose([0, 6, 7], 8)
    assert d.tokens[0] == 1 and d.probs[0] == 0.75 and d.support == 4
    # Spec length is at most spec_factor x the match: a 2-token match drafts <= 2, a 3-token 3.
    assert len(d.tokens) == 2 and d.match == 2
    long = idx.propose([5, 6, 7], 8)
    assert long.match == 3 and long.tokens == [1, 2, 3]
    # min_prob: where the continuations disagree too much, the draft stops.
    idx2 = SuffixIndex(SuffixConfig(key=2, min_prob=0.6))
    idx2.add(0, [1, 2, 3, 4])
    idx2.add(1, [1, 2, 5, 4])
    assert idx2.propose([1, 2], 4) is None


PROMPTS = [[256, *f"tool call {i % 4}: get_weather(city=".encode()] for i in range(12)]


def test_suffix_and_cost_policy_are_token_identical_to_ar_with_a_warm_cache(tiny64):
    ref = ar_reference(tiny64, PROMPTS, 32)
    bundle = make_bundle(tiny64)
    for method in ("suffix", "adaflash-cost"):
        engine = Engine(tiny64, bundle, EngineConfig(method=method, max_running=6, calibrate=False))
        for i, out in enumerate(ref[:6]):  # the tenant served the first half before
            engine.suffix_cache.add("acme", f"r{i}", out)
        reqs = [engine.submit(Request(p, GenParams(max_tokens=32), tenant_id="acme")) for p in PROMPTS]
        engine.run_until_idle()
        assert [r.output_ids for r in reqs] == ref, method
        rounds = [rd for r in reqs[6:] for rd in r.rounds]
        suffix = [rd for rd in rounds if rd.proposer == "suffix"]
        assert suffix, method
        assert sum(rd.accepted for rd in suffix) > len(suffix), method  # it learned the answers


def test_suffix_sampling_matches_target_distribution():
    target = _tiny_vocab_target()
    prompt, n, temperature, samples = [0, 1, 2, 0, 1], 3, 1.0, 6000
    engine = Engine(
        target, None, EngineConfig(method="suffix", max_running=64, max_queue=samples, max_model_len=16)
    )
    g = torch.Generator().manual_seed(0)
    for i in range(40):  # a cache whose continuations are often, not always, what the target samples
        engine.suffix_cache.add(
            "anonymous", f"r{i}", [2, 0, 1, *torch.randint(0, 5, (6,), generator=g).tolist()]
        )
    reqs = [engine.submit(Request(prompt, GenParams(max_tokens=n, temperature=temperature, seed=i)))
            for i in range(samples)]  # fmt: skip
    engine.run_until_idle()
    counts = torch.zeros((target.config.vocab_size,) * n, dtype=torch.float64)
    for r in reqs:
        counts[tuple(r.output_ids)] += 1
    rounds = [rd for r in reqs for rd in r.rounds if rd.proposer == "suffix"]
    assert sum(rd.accepted for rd in rounds) > 300
    assert sum(rd.verify_len - 1 - rd.accepted for rd in rounds) > 300
    assert _chi2_pvalue(counts, _exact_law(target, prompt, n, temperature)) > 1e-3


def test_a_tenant_never_gets_drafts_from_another_tenants_responses(tiny64):
    prompt = [256, *b"the secret answer is: "]
    answer = ar_reference(tiny64, [prompt], 40)[0]
    for cross in (False, True):
        cfg = EngineConfig(method="suffix", max_running=2, suffix=SuffixCacheConfig(cross_tenant=cross))
        engine = Engine(tiny64, None, cfg)
        engine.suffix_cache.add("tenant-a", "a1", answer)
        req = engine.submit(Request(prompt, GenParams(max_tokens=40), tenant_id="tenant-b"))
        engine.run_until_idle()
        assert req.output_ids == answer
        from_cache = sum(rd.accepted for rd in req.rounds if rd.proposer == "suffix")
        own = engine.suffix_cache.propose("tenant-b", prompt + answer[:5], 8)
        if cross:
            assert own is not None and from_cache > 10  # opted in: B learns from A's history
        else:
            assert own is None and engine.suffix_cache.tenants() == ["tenant-a"]
            # Only the request's own text can propose; the answer never repeats itself here.
            alone = Engine(tiny64, None, EngineConfig(method="suffix", max_running=2))
            r2 = alone.submit(Request(prompt, GenParams(max_tokens=40), tenant_id="tenant-b"))
            alone.run_until_idle()
            assert [(rd.verify_len, rd.accepted) for rd in req.rounds] == [
                (rd.verify_len, rd.accepted) for rd in r2.rounds
            ]


def test_cache_stays_within_its_caps_and_evicts_least_recently_used():
    cache = SuffixCache(SuffixCacheConfig(max_tokens_per_tenant=1_000, max_tokens=2_500))
    g = torch.Generator().manual_seed(1)
    for i in range(300):
        tenant = f"t{i % 4}"
        cache.add(tenant, f"r{i}", torch.randint(0, 500, (50,), generator=g).tolist())
        s = cache.stats()
        assert s.tokens <= 2_500
        assert all(len(cache.contents(t)) * 50 <= 1_000 for t in cache.tenants())
    assert cache.stats().evicted == 300 - cache.stats().responses
    # A response a proposal used is kept over older unused ones.
    small = SuffixCache(SuffixCacheConfig(max_tokens_per_tenant=30, min_tokens=1))
    small.add("t", "old", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    small.add("t", "mid", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    small.add("t", "new", [21, 22, 23, 24, 25, 26, 27, 28, 29, 30])
    assert small.propose("t", [1, 2, 3], 4).tokens == [4, 5, 6]
    small.add("t", "newest", [31, 32, 33, 34, 35, 36, 37, 38, 39, 40])
    kept = small.contents("t")
    assert [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] in kept and [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] not in kept
    assert not small.add("t", "new", [1, 2, 3, 4])  # a replayed record is not learned twice


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=1, max_size=80),
    st.booleans(),
)
def test_eviction_keeps_every_cap_and_its_token_count_under_any_traffic(ops, cross_tenant):
    """Adds and proposals across tenants (with and without the cross-tenant index): the token
    count the caps are held to is what the indexes hold, and each index evicts its own least
    recently used response first."""
    from adaflash.serving.suffix_cache import GLOBAL

    cache = SuffixCache(SuffixCacheConfig(max_tokens_per_tenant=120, max_tokens=300, min_tokens=1,
                                          cross_tenant=cross_tenant))  # fmt: skip
    for i, (t, n, ask) in enumerate(ops):
        tokens = [1000 + i] + [(i * 7 + j) % 50 for j in range(n)]  # unique: the first token
        if ask:
            cache.propose(f"t{t}", tokens[1:4], 4)
        before = {name: cache.contents(name) for name in [*cache.tenants(), GLOBAL]}
        cache.add(f"t{t}", f"r{i}", tokens)
        names = [*cache.tenants(), GLOBAL]
        held = {name: cache.contents(name) for name in names}
        assert cache.stats().tokens == sum(len(s) for seqs in held.values() for s in seqs) <= 300
        assert all(sum(map(len, held[name])) <= 120 for name in cache.tenants())
        for name in names:  # what an index lost is a prefix of its LRU order
            old = [s for s in before.get(name, []) if s != tokens]
            gone = [s for s in old if s not in held[name]]
            assert gone == old[: len(gone)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=6), st.lists(st.integers(0, 9), max_size=6),
       st.integers(-14, 14), st.integers(-14, 14))  # fmt: skip
def test_token_view_reads_like_the_concatenated_list(head, tail, a, b):
    from adaflash.serving.lookup import TokenView

    view, ref = TokenView(head, tail), head + tail
    assert len(view) == len(ref) and view[a:b] == ref[a:b] and view[a:] == ref[a:] and view[:b] == ref[:b]
    for i in (a, b):
        if -len(ref) <= i < len(ref):
            assert view[i] == ref[i]


def test_sure_lockstep_drafts_stay_token_identical_to_ar(tiny64, monkeypatch):
    """The lockstep option (`ProposerConfig.lockstep_min_prob`) on a one-wave batch of eight whose
    answers the tenant's cache holds. The priced plan is made to give up every step (as at C >= 8
    on this CPU), so every draft verified comes from `lockstep.confident`: the longest requests'
    sure model-free drafts, together. Every output is still AR's."""
    from adaflash.serving import lockstep
    from tests.test_cost_policy import _costs

    prompts = [[256, *f"row {i}: select name from t{i % 3} where id =".encode()] for i in range(8)]
    ref = ar_reference(tiny64, prompts, 24)
    monkeypatch.setattr(lockstep, "critical", lambda reqs, chosen: [lockstep.NONE] * len(reqs))
    cfg = EngineConfig(method="adaflash-cost", max_running=8, calibrate=False, lockstep_min_prob=0.9)
    engine = Engine(tiny64, make_bundle(tiny64), cfg)
    assert engine.policy.config.lockstep_min_prob == 0.9
    # Fixed costs (verify rows nearly free, a drafter forward dear), so the plan's value does not
    # depend on this machine's load.
    costs = engine.policy.costs = _costs(
        {1: 0.05, 64: 0.06, 1024: 0.5}, {1: 0.15, 64: 0.3}, {1: 0.01, 512: 0.05}
    )
    costs.target.rate = costs.drafter_block.rate = costs.drafter_lm.rate = 0.0
    for i, out in enumerate(ref):
        engine.suffix_cache.add("acme", f"r{i}", out)
    reqs = [engine.submit(Request(p, GenParams(max_tokens=24), tenant_id="acme")) for p in prompts]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ref
    drafted = [rd for r in reqs for rd in r.rounds if rd.proposer in ("suffix", "ngram")]
    assert drafted and sum(rd.accepted for rd in drafted) > len(drafted) / 2
