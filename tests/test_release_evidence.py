"""What the cost policy starts from: a drafter's release evidence and the suffix reliability table.

- A drafter's checkpoint carries its held-out acceptance (`models/evidence.py`); the policy that
  installs it starts from that curve, not one generic prior, and a hot reload re-reads it.
- Malformed evidence is refused at load with a one-line reason (a bad checkpoint never serves).
- The pipeline's register step stamps the shadow evaluation into a copy it registers, never into
  its input artifact.
- Suffix drafts are priced per bin of their own estimate and per source (the request's own text or
  its tenant's history): weak matches that miss do not price out strong ones that hold.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.errors import CheckpointError
from adaflash.models.checkpoint import META, load_drafter_for, save_drafter, stamp_evidence
from adaflash.models.evidence import AcceptanceEvidence
from adaflash.serving.acceptance import AcceptanceStats, Reliability
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.policy import CostPolicy
from tests.conftest import REPO, make_bundle


def _saved(tmp_path, tiny64, name="d", evidence=None):
    b = make_bundle(tiny64, block_size=8)
    out = save_drafter(tmp_path / name, b.drafter, b.length_head, b.meta)
    if evidence is not None:
        stamp_evidence(out, evidence)
    return out


@given(st.floats(1.0, 7.5), st.integers(1, 15))
@settings(max_examples=60, deadline=None)
def test_geometric_evidence_implies_the_tau_it_was_built_from(tau, positions):
    ev = AcceptanceEvidence.from_tau(tau, positions, 10, "test")
    assert all(b <= a for a, b in zip(ev.survival, ev.survival[1:], strict=False))
    assert ev.tau == pytest.approx(min(tau, 1 + positions * 0.999), abs=positions * 1e-4 + 1e-3)


def test_stats_from_evidence_start_at_its_curve_and_served_rounds_take_over():
    survival = [0.7, 0.45, 0.25, 0.1]
    s = AcceptanceStats.from_survival(4, survival, weight=8.0)
    assert s.survival() == pytest.approx(survival, abs=1e-9)
    for _ in range(200):  # served traffic says nothing after the first draft is ever accepted
        s.observe(4, 0)
    assert s.survival()[0] < 0.1


def test_a_policy_prices_an_installed_drafter_by_its_evidence_and_a_reload_rereads_it(tmp_path, tiny64):
    strong = AcceptanceEvidence.from_tau(3.0, 7, 400, "held-out")
    weak = AcceptanceEvidence.from_tau(1.3, 7, 400, "held-out")
    a = load_drafter_for(_saved(tmp_path, tiny64, "a", strong), tiny64)
    b = load_drafter_for(_saved(tmp_path, tiny64, "b", weak), tiny64)
    bare = load_drafter_for(_saved(tmp_path, tiny64, "c"), tiny64)
    assert a.evidence == strong and bare.evidence is None
    engine = Engine(tiny64, a, EngineConfig(method="adaflash-cost", max_running=2), "va")
    policy: CostPolicy = engine.policy
    assert sum(policy.stats["drafter"].survival()) == pytest.approx(strong.tau - 1, rel=0.02)
    policy.install(b, "vb")
    assert sum(policy.stats["drafter"].survival()) == pytest.approx(weak.tau - 1, rel=0.05)
    policy.install(bare, "vc")  # no evidence: the generic prior
    assert policy.stats["drafter"].survival() == AcceptanceStats(7).survival()
    # ... and it serves, lossless as ever (the evidence changes choices, never tokens).
    engine.policy.install(a, "va")
    req = engine.submit(Request([256, *b"abcabc abc"], GenParams(max_tokens=12, temperature=0.0)))
    engine.run_until_idle()
    assert req.finished and len(req.output_ids) == 12


@pytest.mark.parametrize(
    "bad",
    [
        {"survival": [0.5, 0.6], "rounds": 3, "source": "x"},  # increasing
        {"survival": [1.5], "rounds": 3, "source": "x"},  # not a probability
        {"survival": [], "rounds": 3, "source": "x"},
        {"survival": "0.5", "rounds": 3},
        {"survival": [0.5], "rounds": -1},
        ["not", "a", "dict"],
    ],
)
def test_malformed_evidence_is_refused_at_load_with_a_reason(tmp_path, tiny64, bad):
    d = _saved(tmp_path, tiny64)
    meta = json.loads((d / META).read_text())
    meta["acceptance"] = bad
    (d / META).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="acceptance"):
        load_drafter_for(d, tiny64)


def test_register_stamps_the_shadow_evaluation_into_a_copy_not_its_input(tmp_path, tiny64):
    from adaflash.components.steps import with_shadow_evidence

    d = _saved(tmp_path, tiny64)
    before = (d / META).read_bytes()
    shadow = {"domains": {"all": {"n": 12, "tau_full": 2.4, "full_rounds": 300}}}
    out = with_shadow_evidence(d, shadow, tmp_path / "tmp")
    assert (d / META).read_bytes() == before and out != d and out.name == d.name
    ev = load_drafter_for(out, tiny64).evidence
    assert ev is not None and ev.rounds == 300 and ev.tau == pytest.approx(2.4, abs=0.01)
    assert "12 held-out records" in ev.source
    assert with_shadow_evidence(d, {"domains": {}}, tmp_path / "tmp2") == d  # nothing measured


def test_the_shipped_drafter_carries_its_held_out_evidence():
    shipped = REPO / "drafters" / "smollm2"
    meta = json.loads((shipped / "adaflash.json").read_text())
    metrics = json.loads((shipped / "bootstrap_metrics.json").read_text())
    ev = AcceptanceEvidence.parse(meta["acceptance"], "shipped")
    assert ev.tau == pytest.approx(metrics["heldout"]["all"]["dflash_tau"], abs=0.01)


def test_reliability_prices_strong_estimates_apart_from_weak_ones():
    r = Reliability()
    for _ in range(60):
        r.observe([0.95, 0.93], known=2, hits=2)  # strong matches: held
        r.observe([0.3, 0.25], known=2, hits=0)  # weak matches: missed
    assert r.factor(0.95) > 0.9 and r.factor(0.3) < 0.2
    curve = r.survival([0.95, 0.3, 0.92])
    assert curve[0] > 0.85 and curve[1] < 0.1 and curve[2] <= curve[1]  # never rises with depth


def test_the_policy_calibrates_own_and_tenant_suffix_drafts_apart(tiny64):
    engine = Engine(tiny64, make_bundle(tiny64), EngineConfig(method="adaflash-cost", max_running=2), "v")
    policy: CostPolicy = engine.policy
    req = Request([256, 1, 2, 3], GenParams(max_tokens=4))
    req.suffix_probs, req.suffix_source = [0.9, 0.8], "tenant"
    for _ in range(50):
        policy._calibrate("suffix", req, 2, 0, verified=True)  # the tenant history's 0.9 matches keep missing
    req.suffix_source = "own"
    assert policy._lookup_survival(req, "suffix", [5, 6])[0] == pytest.approx(0.9 * 0.8)  # own: prior
    req.suffix_source = "tenant"
    assert policy._lookup_survival(req, "suffix", [5, 6])[0] < 0.2
