"""Prompt lookup (`ngram`) on the serving engine: no drafter needed, lossless like the others."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.models.ngram import NgramIndex, propose
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from tests.conftest import ar_reference
from tests.test_speculative import _chi2_pvalue, _exact_law, _tiny_vocab_target, engine_sample_counts

# Repetitive prompts so that lookup finds matches (and misses) in the prompt and the output.
PROMPTS = [[256, *f"ab{i % 3}ab{i % 3} {'xyz' * (i % 4)} q{i}: ab".encode()] for i in range(16)]


def test_ngram_is_token_identical_to_ar_without_a_drafter(tiny64):
    ref = ar_reference(tiny64, PROMPTS, 40)
    engine = Engine(tiny64, None, EngineConfig(method="ngram", max_running=6))
    reqs = [engine.submit(Request(p, GenParams(max_tokens=40, temperature=0.0))) for p in PROMPTS]
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == ref
    rounds = [rd for r in reqs for rd in r.rounds]
    assert any(rd.verify_len > 1 and rd.accepted > 0 for rd in rounds)  # lookup drafted and hit
    assert any(rd.verify_len > 1 and rd.accepted < rd.verify_len - 1 for rd in rounds)  # and missed
    assert all(rd.verify_len <= 8 for rd in rounds) and all(len(r.output_ids) == 40 for r in reqs)


def test_ngram_sampling_matches_target_distribution():
    target = _tiny_vocab_target()
    prompt, n, temperature = [0, 1, 2, 0, 1], 3, 1.0
    counts, rounds, _ = engine_sample_counts(target, None, "ngram", prompt, n, temperature, 6000)
    assert (
        sum(rd.accepted for rd in rounds) > 300
        and sum(rd.verify_len - 1 - rd.accepted for rd in rounds) > 300
    )
    assert _chi2_pvalue(counts, _exact_law(target, prompt, n, temperature)) > 1e-3


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    count=st.integers(0, 9),
)
def test_incremental_index_proposes_exactly_what_the_scan_does(tokens, cuts, count):
    """The serving engine's per-request `NgramIndex`, fed in arbitrary increments, proposes what
    the reference backwards scan proposes after every increment."""
    index = NgramIndex()
    for end in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        index.sync(tokens[:end])
        assert index.propose(count) == propose(tokens[:end], count)
