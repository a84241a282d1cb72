"""`adaflash-cost`: the measured-cost choice of proposer (drafter / n-gram / none) and k̂.

Whatever it picks, outputs stay lossless (greedy token-identical, sampling law exact). The choice
itself follows the measured costs: a drafter that costs more than it brings is not run (except
the periodic exploration round), free verify rows are used, and n-gram drafts are taken when
they promise more per second than the drafter.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.serving.acceptance import AcceptanceStats, Reliability
from adaflash.serving.costs import Candidate, CostCurve, StepCosts, TargetCost, choose
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.policy import EXPLORE_EVERY
from tests.conftest import ar_reference, make_bundle
from tests.test_speculative import (
    _chi2_pvalue,
    _exact_law,
    _flat_drafter,
    _tiny_vocab_target,
    engine_sample_counts,
    quick_train,
)

# Repetitive and plain prompts: n-gram lookup hits on some, misses on others.
PROMPTS = [[256, *f"ab{i % 3}ab{i % 3} {'xyz' * (i % 4)} q{i}: {i * 7}".encode()] for i in range(16)]


def _curve(points: dict[int, float]) -> CostCurve:
    c = CostCurve(1024)
    for n, s in points.items():
        c.set(n, s)
    return c


def _costs(target: dict[int, float], block: dict[int, float], lm: dict[int, float]) -> StepCosts:
    return StepCosts(TargetCost.single(_curve(target)), _curve(block), _curve(lm))


@pytest.fixture(scope="module")
def trained(tiny64):
    return quick_train(make_bundle(tiny64, block_size=8, seed=4), tiny64, 40, seed=4)


def test_cost_policy_is_token_identical_to_ar(tiny64, trained):
    ref = ar_reference(tiny64, PROMPTS, 40)
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=6), "v1")
    reqs = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0.0))) for p in PROMPTS]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ref
    rounds = [rd for r in reqs for rd in r.rounds]
    for r in reqs:  # the feedback schema's round convention holds whatever the proposer
        for a, b in zip(r.rounds, r.rounds[1:], strict=False):
            assert b.start == a.start + a.accepted + 1
    used = {rd.proposer for rd in rounds if rd.verify_len > 1}
    assert used, "the policy never drafted on a target where drafts are cheap"
    assert all(rd.verify_len <= 8 for rd in rounds)


def test_cost_policy_sampling_matches_target_distribution():
    target = _tiny_vocab_target()
    bundle = _flat_drafter(target)
    prompt, n, temperature = [0, 1, 2, 0, 1], 3, 1.0
    counts, rounds, _ = engine_sample_counts(target, bundle, "adaflash-cost", prompt, n, temperature, 6000)
    drafted = [rd for rd in rounds if rd.verify_len > 1]
    assert sum(rd.accepted for rd in drafted) > 200
    assert sum(rd.verify_len - 1 - rd.accepted for rd in drafted) > 200
    assert _chi2_pvalue(counts, _exact_law(target, prompt, n, temperature)) > 1e-3


def test_a_drafter_that_costs_more_than_it_brings_only_runs_to_explore(tiny64):
    useless = make_bundle(tiny64, block_size=8, seed=9)  # random: almost nothing accepted
    engine = Engine(tiny64, useless, EngineConfig(method="adaflash-cost", max_running=4), "v1")
    # This machine's shape of costs, exaggerated: a drafter forward costs 3 target steps.
    engine.policy.costs = _costs({1: 0.05, 64: 0.06, 1024: 0.5}, {1: 0.15, 64: 0.3}, {1: 0.01, 512: 0.05})
    engine.policy.costs.target.rate = engine.policy.costs.drafter_block.rate = 0.0  # keep them
    forwards = []  # drafter block forwards, per step: an exploration pays one even if refined away
    block = engine.policy.drafter.forward
    engine.policy.drafter.forward = lambda reqs: forwards.append(len(reqs)) or block(reqs)
    reqs = [engine.submit(Request(p, GenParams(max_tokens=60, temperature=0.0))) for p in PROMPTS[:4]]
    steps = drafter_steps = 0
    while (stats := engine.step()) is not None:
        steps += 1
        drafter_steps += "drafter" in stats.proposers
    assert all(len(r.output_ids) == 60 for r in reqs)
    assert drafter_steps <= steps / EXPLORE_EVERY + 1, (drafter_steps, steps)
    # Four requests and no queue decode in lockstep: a forced drafter round for one of them
    # saves the batch no step, so none is explored there. A lone request still explores.
    assert forwards == [], forwards
    table = engine.policy.drafter_reliability
    for _ in range(100):  # every chosen round failed: with â known, no round is worth drafting
        table.observe([0.3, 0.1, 0.05], 3, 0)
    before = sum(table.estimated)
    alone = engine.submit(Request(PROMPTS[0], GenParams(max_tokens=2 * EXPLORE_EVERY, temperature=0.0)))
    engine.run_until_idle()
    assert len(alone.output_ids) == 2 * EXPLORE_EVERY and forwards
    # The forced round is an acceptance sample: its full room verified although the policy, with â
    # known, would refine it to a draft or none (else the table could never learn the drafter back).
    explored = [rd for rd in alone.rounds if rd.proposer == "drafter"]
    assert explored and max(rd.verify_len for rd in explored) == engine.policy.block_size
    assert sum(table.estimated) > 0.99**3 * before  # ... and feeds the table (decay alone: less)


def test_choose_skips_drafting_when_rows_cost_more_than_acceptance_brings():
    # 1 row 50 ms, every extra row +10 ms: a draft accepted 5% of the time is not worth a row.
    costs = _costs({1: 0.05, 1024: 0.05 + 1023 * 0.01}, {1: 0.02}, {1: 0.001})
    poor = Candidate([0.05, 0.01], 2, [0.05, 0.01, 0.0], 3)
    opts, rate = choose([poor] * 4, costs, base_rows=4, base_tokens=4.0)
    assert [o.proposer for o in opts] == ["none"] * 4
    assert rate == pytest.approx(4 / costs.seconds(4, 0, 0))


def test_choose_uses_free_rows_and_prefers_the_better_proposer():
    # Verifying up to 16 rows costs the same as 1 (this CPU at C = 1); the drafter forward is 40%
    # of a step. A strong n-gram match beats a mediocre drafter; a weak one loses to it.
    costs = _costs({1: 0.05, 16: 0.051, 1024: 0.5}, {1: 0.02, 4: 0.03}, {1: 0.002, 64: 0.01})
    drafter = [0.5, 0.3, 0.15, 0.08, 0.04, 0.02, 0.01]
    strong_ngram = Candidate([0.9, 0.8, 0.7, 0.6], 4, drafter, 7)
    opts, _ = choose([strong_ngram], costs, base_rows=1, base_tokens=1.0)
    assert opts[0].proposer == "ngram" and opts[0].drafts == 4
    weak_ngram = Candidate([0.1], 1, drafter, 7)
    opts, _ = choose([weak_ngram], costs, base_rows=1, base_tokens=1.0)
    assert opts[0].proposer == "drafter" and opts[0].drafts >= 4
    no_match = Candidate([], 0, [0.01] * 7, 7)  # a drafter this weak does not pay for its forward
    opts, _ = choose([no_match], costs, base_rows=1, base_tokens=1.0)
    assert opts[0].proposer == "none"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.001, 0.5), min_size=3, max_size=3),
    st.lists(
        st.tuples(st.lists(st.floats(0, 1), max_size=7), st.lists(st.floats(0, 1), max_size=7)),
        min_size=1,
        max_size=8,
    ),
)
def test_choose_never_expects_less_than_plain_decoding(prices, reqs):
    t1, row, block = prices
    costs = _costs({1: t1, 1024: t1 + 1023 * row * 0.01}, {1: block}, {1: block / 10})
    cands = []
    for ng, dr in reqs:  # survival curves are non-increasing
        ng = [min(ng[: i + 1]) for i in range(len(ng))]
        dr = [min(dr[: i + 1]) for i in range(len(dr))]
        cands.append(Candidate(ng, len(ng), dr, len(dr)))
    n = len(cands)
    opts, rate = choose(cands, costs, base_rows=n, base_tokens=float(n))
    assert rate >= n / costs.seconds(n, 0, 0) - 1e-9
    for c, o in zip(cands, opts, strict=True):
        limit = c.ngram_limit if o.proposer == "ngram" else c.drafter_limit if o.proposer == "drafter" else 0
        assert 0 <= o.drafts <= limit


def test_cost_curve_learns_from_steps_and_acceptance_stats_respect_censoring():
    c = _curve({1: 0.1, 64: 0.1})
    for _ in range(300):  # the truth: 0.1 s + 2 ms per row
        for n in (1, 4, 16, 64):
            c.observe(n, 0.1 + 0.002 * n)
    assert c(64) == pytest.approx(0.228, rel=0.05) and c(4) == pytest.approx(0.108, rel=0.05)
    s = AcceptanceStats(4, prior_weight=0.0, decay=1.0)
    s.observe(drafted=2, accepted=2)  # both verified drafts accepted: position 3 never tried
    s.observe(drafted=4, accepted=1)  # position 2 tried and rejected, 3-4 not reached
    cond = s.conditional()
    assert cond[0] == 1.0 and cond[1] == pytest.approx(0.5)
    assert s.tried[2] == 0 and cond[2] == s.prior and s.survival()[1] == pytest.approx(0.5)


def test_a_noisy_middle_probe_never_prices_the_curve_past_it_at_zero():
    """Calibration on a loaded machine: the 128-row probe came out slower than the 1,024-row one.
    Extrapolating that falling line past the last probe gave negative seconds at 4,096 rows, and
    pooling then pulled 128-4,096 rows to zero (a whole-prompt projection priced as free)."""
    c = CostCurve(4096)
    for n, seconds in ((16, 0.001), (128, 0.010), (1024, 0.002)):
        c.set(n, seconds)
    c.make_monotone()
    assert all(v is not None and v >= 0 for v in c.values)
    assert all(c(n) > 0.001 for n in (200, 1024, 4096)) and c(4096) >= c(200)


def test_guard_raises_the_price_of_drafts_while_they_deliver_less_than_plain_steps():
    from adaflash.serving.costs import SpeculationGuard

    g = SpeculationGuard()
    assert g.want_plain_step(8)  # nothing measured yet: a plain step first
    g.observe(8, tokens=8, seconds=0.1, speculated=False)  # 80 tok/s plain
    assert not g.want_plain_step(8)
    for _ in range(5):
        g.observe(8, tokens=12, seconds=0.2, speculated=True)  # 60 tok/s with drafts
    assert g.penalty(8) == pytest.approx(g.step**5, rel=1e-6) and g.penalty(1) == 1.0  # per bucket
    for _ in range(20):
        g.observe(8, tokens=12, seconds=0.2, speculated=True)
    assert g.penalty(8) == g.max_penalty
    for _ in range(40):
        g.observe(8, tokens=30, seconds=0.2, speculated=True)  # 150 tok/s: drafting pays again
    assert g.penalty(8) == 1.0
    for _ in range(g.ar_every):
        g.observe(8, tokens=30, seconds=0.2, speculated=True)
    assert g.want_plain_step(8)  # the comparison is kept current
    # The penalty makes the same drafts unattractive to the policy.
    costs = _costs({1: 0.05, 16: 0.06, 1024: 0.5}, {1: 0.02}, {1: 0.001})
    cand = Candidate([0.2, 0.1], 2, [], 0)
    assert choose([cand], costs, 1, 1.0)[0][0].proposer == "ngram"
    assert choose([cand], costs, 1, 1.0, penalty=20.0)[0][0].proposer == "none"


def test_target_cost_prices_rows_by_the_requests_they_belong_to():
    """32 rows as one request's verify and as 32 requests' decode tokens are different steps;
    levels without a measurement interpolate (in log2 of requests) between measured ones."""
    cost = TargetCost(1024, max_requests=32, rate=0.5)
    for rows, sec in ((1, 0.05), (32, 0.10), (256, 0.50)):
        cost.set(1, rows, sec)
    for rows, sec in ((32, 0.14), (64, 0.24), (256, 0.60)):
        cost.set(32, rows, sec)
    assert cost(32, 1) == pytest.approx(0.10) and cost(32, 32) == pytest.approx(0.14)
    assert cost(32, 4) == pytest.approx(0.10 + 0.4 * 0.04)  # log2(4) = 2 of 5 levels up
    # the marginal verify row of a batch-32 step is priced from the batch-32 curve
    assert cost(64, 32) - cost(32, 32) == pytest.approx(0.10)
    cost.observe(64, 32, 0.34)  # an observed step moves the curve at its own level only
    assert cost(64, 32) > 0.24 and cost(64, 1) == pytest.approx(0.10 + 32 * (0.40 / 224))


def test_without_a_queue_only_the_longest_requests_draft_and_only_all_together():
    """No request waiting: the batch runs until its longest request ends, so a draft for a shorter
    request (or for some of the longest only) saves no step; the plan drafts for every longest
    request or for none."""
    from adaflash.serving.costs import Option
    from adaflash.serving.lockstep import critical

    def req(done: int) -> Request:
        r = Request([1, 2, 3], GenParams(max_tokens=40, temperature=0.0))
        r.output_ids = [7] * done
        return r

    reqs = [req(10), req(11), req(30)]  # 30, 29 and 10 tokens left: the first two are the longest
    d, n, none = Option("drafter", 4, 0.0), Option("ngram", 2, 0.0), Option("none", 0, 0.0)
    assert critical(reqs, [d, n, d]) == [d, n, none]  # the short one never drafts
    assert critical(reqs, [d, none, d]) == [none] * 3  # one longest AR round: no step saved
    assert critical(reqs, [none, none, d]) == [none] * 3


def test_a_lockstep_plan_is_valued_by_the_expected_minimum_of_its_requests_acceptance():
    """Without a queue a batch advances by its slowest longest request: eight requests each
    accepting a first draft with p = 0.6 save 0.6^8 steps, so a plan that pays for itself on the
    sum of expected tokens (4.8 for ~1.5x the step's time) runs plain; one request drafting alone
    keeps its draft."""
    from adaflash.serving.costs import Candidate, Option, lockstep_gain
    from adaflash.serving.lockstep import lockstep

    assert lockstep_gain([[0.6]] * 8) == pytest.approx(0.6**8)
    assert lockstep_gain([[0.9, 0.8], [0.5]]) == pytest.approx(0.45)  # min ≤ 1 draft: one term
    assert lockstep_gain([[0.9, 0.8], [0.5, 0.5]]) == pytest.approx(0.45 + 0.4)

    costs = _costs({1: 0.10, 8: 0.12, 16: 0.15, 64: 0.3}, {1: 0.01, 8: 0.02}, {1: 0.001, 64: 0.01})
    cand = Candidate([0.6], 1, [], 0)
    ngram, none = Option("ngram", 1, 0.6), Option("none", 0, 0.0)
    assert lockstep(costs, 1.0, [cand] * 8, [ngram] * 8, 8, 0, 8) == [none] * 8
    alone = [ngram] + [none] * 7  # one longest request: its draft saves a wave step with p = 0.6
    assert lockstep(costs, 1.0, [cand] * 8, alone, 8, 0, 8) == alone


def test_guard_keeps_a_noisy_drafter_that_wins_on_average_and_prices_out_one_that_loses():
    """At C = 1 a speculative step commits 1 token or several: most steps alone are slower than
    plain ones. The guard judges what drafting delivers over many steps, not step by step (the
    previous EMA of per-step rates with ×1.5 up / ÷1.1 down priced the winning drafter below out
    on 25% of its steps)."""
    import random

    from adaflash.serving.costs import SpeculationGuard

    def priced_out(p_hit: float, hit_tokens: int) -> float:
        """Share of steps with the draft price above 2×, over 20 seeded 200-step runs."""
        high = 0
        for seed in range(20):
            rng, g = random.Random(seed), SpeculationGuard()
            for i in range(200):
                if i % g.ar_every == 0:
                    g.observe(1, tokens=1, seconds=0.05, speculated=False)  # 20 tok/s plain
                tokens = hit_tokens if rng.random() < p_hit else 1
                g.observe(1, tokens=tokens, seconds=0.06, speculated=True)
                high += g.penalty(1) > 2
        return high / (20 * 200)

    assert priced_out(0.3, 3) < 0.1  # 1.6 tokens per 0.06 s = 26.7 tok/s: drafting pays
    assert priced_out(0.05, 2) > 0.8  # 1.05 tokens per 0.06 s = 17.5 tok/s: it does not


def test_guard_price_drifts_back_during_plain_steps_so_drafting_is_never_locked_out():
    from adaflash.serving.costs import SpeculationGuard

    g = SpeculationGuard()
    g.observe(1, tokens=1, seconds=0.05, speculated=False)
    for _ in range(30):
        g.observe(1, tokens=1, seconds=0.2, speculated=True)  # a bad spell: the price maxes out
    assert g.penalty(1) == g.max_penalty
    steps = 0
    while g.penalty(1) > 1.0:  # nothing speculates at that price; plain steps alone bring it down
        g.observe(1, tokens=1, seconds=0.05, speculated=False)
        steps += 1
    assert steps < 200


def test_without_a_queue_sure_model_free_drafts_can_save_a_step_the_priced_plan_gave_up():
    """The rate objective drafts long for every request; in lockstep eight long drafts save
    E[min accepted] ≈ nothing, so the step ran plain. `confident` keeps each longest request's
    drafts estimated at ≥ min_prob, cut to the shortest such run: a plan the lockstep value keeps."""
    from adaflash.serving.costs import Option
    from adaflash.serving.lockstep import confident, lockstep

    def req(done: int) -> Request:
        r = Request([1, 2, 3], GenParams(max_tokens=40, temperature=0.0))
        r.output_ids = [7] * done
        return r

    reqs = [req(10)] * 7 + [req(30)]  # seven longest requests, one short
    sure = Candidate([], 0, [], 0, {"suffix": ([0.97, 0.95, 0.6, 0.5, 0.4], 5)})
    surer = Candidate([0.99, 0.98, 0.97], 3, [], 0, {"suffix": ([0.96, 0.5], 2)})
    cands = [sure] * 6 + [surer, sure]
    plan = confident(reqs, cands, 0.9)
    assert plan[:6] == [Option("suffix", 2, pytest.approx(1.92))] * 6
    assert plan[6] == Option("ngram", 2, pytest.approx(1.97))  # its surest proposer, cut to 2
    assert plan[7] == Option("none", 0, 0.0)  # the short request never drafts
    unsure = Candidate([0.8], 1, [], 0)  # one longest request without a sure draft: no plan
    assert confident(reqs, [unsure] + cands[1:], 0.9) is None

    # Verify rows cost (a C = 8 step on this CPU): 41 rows of long drafts do not pay, 22 sure ones do.
    costs = _costs({1: 0.10, 8: 0.12, 16: 0.16, 64: 0.5}, {1: 0.01, 8: 0.02}, {1: 0.001, 64: 0.01})
    long = [Option("suffix", 5, 3.4)] * 6 + [Option("ngram", 3, 2.9), Option("none", 0, 0.0)]
    assert lockstep(costs, 1.0, cands, long, 8, 0, 8) == [Option("none", 0, 0.0)] * 8
    assert lockstep(costs, 1.0, cands, plan, 8, 0, 8) == plan


def test_a_long_context_projection_is_not_counted_as_a_block_forward(tiny64, trained):
    """The first draft after a long prompt projects its whole queued context once: priced as a
    block forward's cost, it held the drafter at several times its cost until it drafted again."""
    import time

    import torch

    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=1), "v1")
    dslots = engine.policy.drafter.dslots
    flush = dslots.flush

    # A projection far dearer than any block forward of this target: 0.25 s of CPU (the policy's
    # clock is this process's CPU time, so a sleep would not show). One torch thread: on a loaded
    # machine a waiting OpenMP thread spins, and a 2-thread block forward of this tiny target
    # then read 0.12 s of process CPU.
    dear = 0.25
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def slow_flush(slots=None):
        if dslots.queued_rows:
            t0 = time.process_time()
            while time.process_time() - t0 < dear:
                pass
        flush(slots)

    dslots.flush = slow_flush
    seen = []
    observe = engine.policy.costs.drafter_block.observe
    engine.policy.costs.drafter_block.observe = lambda n, s, w=1.0: seen.append(s) or observe(n, s, w)
    prompt = [256, *range(1, 240)]  # a long context with nothing for lookup to repeat
    n = 4 * EXPLORE_EVERY  # long enough for the policy to draft (by choice or to explore)
    req = engine.submit(Request(prompt, GenParams(max_tokens=n, temperature=0.0)))
    try:
        engine.run_until_idle()
    finally:
        torch.set_num_threads(threads)
    assert req.output_ids == ar_reference(tiny64, [prompt], n)[0]
    assert seen and max(seen) < dear / 2, seen  # the projection's time stayed out of the block's cost


def test_a_lone_request_is_priced_every_step_a_priced_out_batch_only_every_few(tiny64, trained):
    """A load bucket whose plans chose no draft skips pricing on most steps (the per-request Python
    costs a batch step a few %), but not a lone request: there pricing is ~1 ms of a ~25 ms step
    and suffix matches come and go token by token, so skipping 7 of 8 steps missed most."""
    from adaflash.serving.costs import SpeculationGuard
    from adaflash.serving.policy import IDLE_RECHECK

    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=2), "v1")
    policy = engine.policy
    priced = []  # one `_choose` per priced step (`_candidate` also runs when a drafted block is refined)
    choose_ = policy._choose
    policy._choose = lambda *a: priced.append(1) or choose_(*a)
    policy.guard.want_plain_step = lambda n: False  # no forced plain step in the way

    def steps_priced(requests: int, steps: int = 6, since_draft: int = 0) -> int:
        params = GenParams(max_tokens=40, temperature=0.0)
        reqs = [engine.submit(Request(p, params)) for p in PROMPTS[:requests]]
        while any(not r.output_ids for r in reqs):
            engine.step()  # prefill
        priced.clear()
        for _ in range(steps):
            policy._idle[SpeculationGuard.bucket(requests)] = IDLE_RECHECK + 1  # priced out
            policy.steps_since_draft = since_draft
            engine.step()
        count = len(priced)
        engine.run_until_idle()
        return count

    assert steps_priced(1) == 6
    assert steps_priced(2) == 0
    # Two requests and no queue decode in lockstep, where no exploration round ever runs: one
    # overdue must not make every step priced (it did: a C = 8 closed loop priced all its steps
    # after the first 32, ~2.5% of each).
    assert steps_priced(2, since_draft=10 * EXPLORE_EVERY) == 0


def test_a_cost_request_whose_context_was_dropped_never_drafts_a_fixed_one_still_does(tiny64, trained):
    """Past the drafter context's byte bound an `adaflash-cost` request's queue is dropped, not
    projected: it then decodes without the drafter (exploration included) and stays lossless,
    while a `dflash` request beside it keeps its context and drafts every round."""
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=2), "v1")
    dslots = engine.policy.drafter.dslots
    dslots.flush_bytes = 8 * dslots.drafter.fc.weight.shape[1] * 4  # 8 rows: any prompt is past it
    prompt = [256, *range(1, 120)]  # nothing for lookup to repeat
    n = 4 * EXPLORE_EVERY  # long enough for the policy to explore the drafter
    cost = engine.submit(Request(prompt, GenParams(max_tokens=n, temperature=0.0)))
    fixed = engine.submit(Request(prompt, GenParams(max_tokens=n, temperature=0.0, method="dflash")))
    engine.run_until_idle()
    assert dslots.dropped_rows >= len(prompt)
    assert cost.output_ids == fixed.output_ids == ar_reference(tiny64, [prompt], n)[0]
    assert not any(rd.proposer == "drafter" for rd in cost.rounds)
    assert all(rd.proposer == "drafter" for rd in fixed.rounds)
    from adaflash.serving.metrics import ServingMetrics

    metrics = ServingMetrics(engine).exposition().decode()
    assert f'adaflash_drafter_context{{what="dropped_rows"}} {float(dslots.dropped_rows)}' in metrics


def test_choose_charges_a_drafter_round_its_share_of_the_queued_context():
    """A drafter round that must first project a long queued context (a first draft after a long
    prompt) pays that too: the same drafter that wins without it loses to a weak lookup with it."""
    costs = _costs({1: 0.05, 16: 0.051, 1024: 0.5}, {1: 0.02, 4: 0.03}, {1: 0.002, 64: 0.01})
    drafter = [0.5, 0.3, 0.15, 0.08, 0.04, 0.02, 0.01]
    free = Candidate([0.1], 1, drafter, 7)
    assert choose([free], costs, base_rows=1, base_tokens=1.0)[0][0].proposer == "drafter"
    queued = Candidate([0.1], 1, drafter, 7, drafter_setup=0.1)  # two steps' worth of projection
    assert choose([queued], costs, base_rows=1, base_tokens=1.0)[0][0].proposer == "ngram"


def _serve_a_believed_drafter(engine: Engine, target) -> list[Request]:
    """Three requests served under a drafter the policy believes in (near-certain survival), on
    prompts that lookup cannot repeat, so its rounds get verified; outputs checked against AR."""
    k = engine.policy.block_size
    engine.policy.stats["drafter"] = AcceptanceStats.from_survival(k - 1, [0.99] * (k - 1), 1e6)
    engine.policy.drafter_reliability = Reliability(prior=1.0)  # nor what its earlier rounds did
    plain = [[256, *range(1 + 40 * i, 120 + 40 * i)] for i in range(3)]
    reqs = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0.0))) for p in plain]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ar_reference(target, plain, 40)
    return reqs


def test_a_request_pays_its_queued_context_mostly_near_its_end_and_its_own_drafter_record_counts(
    tiny64, trained
):
    """The one-off context projection is spread over the rounds a request has left (next to
    nothing early in a long answer, all of it on the last token), priced from a curve calibrated
    at start-up; and a request whose drafter rounds delivered less than â promised is priced
    lower than â alone says, while the policy records that for every verified drafter round."""
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=1), "v1")
    policy = engine.policy
    assert policy.costs.drafter_context.ready
    prompt = [256, *range(1, 200)]
    req = engine.submit(Request(prompt, GenParams(max_tokens=100, temperature=0.0)))
    engine.step()  # the prefill: the whole prompt queues for the drafter's context
    rows = policy.drafter.pending_rows(req)
    assert rows >= len(prompt)
    survival = [0.5] * 7
    early = policy._setup(req, survival)
    req.params.max_tokens = len(req.output_ids) + 1  # one token left
    late = policy._setup(req, survival)
    assert late == pytest.approx(policy.costs.drafter_context(rows)) and late > 0
    assert early == pytest.approx(late * (1 + sum(survival)) / (100 - len(req.output_ids)))
    req.params.max_tokens = 100

    a = policy.mean_a_hat or 1.0
    plain = sum(policy._drafter_survival(req, a))
    req.accept_ema.update(drafter_accepted=0.0, drafter_expected=3.0)  # its rounds kept failing
    assert sum(policy._drafter_survival(req, a)) < 0.5 * plain
    assert sum(policy._drafter_survival(req, a, realised=False)) == pytest.approx(plain)
    req.accept_ema.clear()
    engine.run_until_idle()

    # A drafter the policy believes in: its rounds are verified, each leaves the request's record.
    reqs = _serve_a_believed_drafter(engine, tiny64)
    drafted = [r for r in reqs if any(rd.proposer == "drafter" and rd.verify_len > 1 for rd in r.rounds)]
    assert drafted and all("drafter_expected" in r.accept_ema for r in drafted)


def test_ngram_drafts_are_priced_by_how_far_their_estimates_held(tiny64, trained):
    """n-gram estimates (measured conditionals, the first position set to the request's own hit
    rate) promised twice what edit traffic accepted; like suffix drafts, they now pass through a
    reliability table that verification outcomes (verified or scored for free) keep current."""
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=2), "v1")
    policy = engine.policy
    reqs = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0.0))) for p in PROMPTS]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ar_reference(tiny64, PROMPTS, 40)
    assert sum(policy.ngram_reliability.estimated) > 0  # served rounds fed the table
    r = Request(PROMPTS[0], GenParams(max_tokens=40, temperature=0.0))
    r.accept_ema["ngram"] = 0.9
    before = policy._lookup_survival(r, "ngram", [1, 2, 3])
    assert before and r.ngram_probs
    for _ in range(200):  # every position of such drafts fails
        policy.ngram_reliability.observe(r.ngram_probs, 3, 0)
    after = policy._lookup_survival(r, "ngram", [1, 2, 3])
    assert sum(after) < 0.25 * sum(before)


def test_the_drafters_chosen_rounds_are_priced_by_how_far_their_estimates_held(tiny64, trained):
    """The policy drafts where â runs highest, so â's curves promise more on the rounds it chose
    than they deliver (the selection effect n-gram's table corrects). Verified drafter rounds feed
    a reliability table of their own; a table whose rounds all failed prices the drafter down,
    the raw â curve it learns from is left as it was, and a new drafter starts a fresh table."""
    engine = Engine(tiny64, trained, EngineConfig(method="adaflash-cost", max_running=1), "v1")
    policy = engine.policy
    reqs = _serve_a_believed_drafter(engine, tiny64)
    assert sum(policy.drafter_reliability.estimated) > 0  # verified drafter rounds fed it
    # Far below the promised near-certain survival: the random-init-sized drafter misses.
    assert sum(policy.drafter_reliability.hits) < sum(policy.drafter_reliability.estimated)

    a = policy.mean_a_hat or 1.0
    r = Request(reqs[0].prompt_ids, GenParams(max_tokens=40, temperature=0.0))
    raw = policy._drafter_survival(None, a)
    policy.drafter_reliability = Reliability(prior=1.0)
    before = sum(policy._drafter_survival(r, a))
    for _ in range(200):
        policy.drafter_reliability.observe(raw, len(raw), 0)
    assert sum(policy._drafter_survival(r, a)) < 0.25 * before
    assert policy._drafter_survival(None, a) == raw
    policy.install(policy.bundle, "v2")
    assert sum(policy.drafter_reliability.estimated) == 0
