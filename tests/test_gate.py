"""The shadow gate on constructed per-record data: it promotes on evidence and says why it does not."""

from __future__ import annotations

import numpy as np
import pytest

from adaflash.components.gate import GatePolicy, gate, paired_bootstrap
from adaflash.components.steps import ShadowReport, gate_summary


def reports(domains: dict[str, tuple[int, float, float]], seed: int = 0, served_gain: float = 0.0,
            lossless: bool = True) -> tuple[dict, dict]:  # fmt: skip
    """(champion, challenger) shadow reports over the same records: per domain (n, mean gain of
    the challenger's full-block τ, per-record noise of that gain). Champion τ varies a lot
    between records (prompts differ); the pairing is what removes that spread."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for dom, (n, gain, noise) in domains.items():
        base = rng.uniform(1.1, 2.2, n)
        d = gain + rng.normal(0, noise, n) if noise else np.full(n, gain)
        for i in range(n):
            rid = f"{dom}-{i}"
            old[rid] = {"domain": dom, "tau_full": float(base[i]), "tau": 1.2}
            new[rid] = {"domain": dom, "tau_full": float(base[i] + d[i]), "tau": 1.2 + served_gain}

    def report(records: dict, ok: bool) -> dict:
        return {"lossless": ok, "records": records, "domains": {}}

    return report(old, True), report(new, lossless)


def test_clear_win_is_promoted_with_its_interval_and_counts():
    champ, chall = reports({"code": (24, 0.12, 0.05), "math": (8, 0.05, 0.05), "chat": (8, 0.0, 0.05)})
    d = gate(champ, chall)
    assert d.promote, d.reasons
    overall = d.interval("tau_full")
    assert overall.n == 40 and overall.low > 0 and overall.low < overall.gain < overall.high
    assert d.interval("tau_full", "code").n == 24 and d.interval("tau_full", "chat").n == 8
    assert "lower bound above +0.000" in d.reasons[0] and "40 records" in d.reasons[0]
    # The served τ guard's intervals are part of the evidence too.
    assert d.interval("tau", "all") is not None


def test_clear_loss_is_rejected_as_worse():
    champ, chall = reports({"code": (24, -0.1, 0.05), "math": (16, -0.1, 0.05)})
    d = gate(champ, chall)
    assert not d.promote
    assert any("the challenger is worse" in r for r in d.reasons), d.reasons
    assert d.interval("tau_full").high < 0


def test_noise_is_rejected_for_want_of_evidence():
    # Per-record gains of exactly ±0.15 in equal numbers: mean 0, a wide interval around it.
    champ, chall = reports({"code": (32, 0.0, 0.0)})
    for i, rid in enumerate(sorted(chall["records"])):
        chall["records"][rid]["tau_full"] += 0.15 if i % 2 else -0.15
    d = gate(champ, chall)
    assert not d.promote
    assert any(r.startswith("not enough evidence") for r in d.reasons), d.reasons
    iv = d.interval("tau_full")
    assert iv.low < 0 < iv.high and abs(iv.gain) < 1e-9
    # Not a loss either: no reason calls it worse or a regression.
    assert not any("worse" in r or "regresses" in r for r in d.reasons)


def test_one_domain_regression_vetoes_an_overall_win():
    doms = {"code": (32, 0.15, 0.03), "chat": (8, -0.12, 0.02)}
    champ, chall = reports(doms)
    d = gate(champ, chall)
    assert d.interval("tau_full").low > 0  # the overall win is real...
    assert not d.promote  # ...but chat really regressed
    assert any(r.startswith("domain chat regresses: tau_full chat") for r in d.reasons), d.reasons
    # The same dip in a domain with too few records to judge cannot veto on its own.
    few_champ, few_chall = reports({"code": (32, 0.15, 0.03), "chat": (3, -0.12, 0.02)})
    assert gate(few_champ, few_chall).promote


def test_served_tau_is_guarded_when_gating_on_full_block_tau():
    champ, chall = reports({"code": (24, 0.1, 0.03)}, served_gain=-0.1)
    d = gate(champ, chall)
    assert not d.promote and any("domain all regresses: tau all" in r for r in d.reasons), d.reasons
    # Gating on served τ itself: the same data is a clear loss.
    assert not gate(champ, chall, GatePolicy(metric="tau")).promote


def test_too_few_records_min_gain_and_lossless_each_reject():
    champ, chall = reports({"code": (8, 0.2, 0.02)})
    d = gate(champ, chall)
    assert not d.promote and "not enough evidence: 8 paired held-out records, the gate needs 16" in d.reasons
    assert gate(champ, chall, GatePolicy(min_records=8)).promote
    champ, chall = reports({"code": (32, 0.05, 0.02)})
    assert gate(champ, chall).promote
    assert not gate(champ, chall, GatePolicy(min_gain=0.1)).promote
    champ, chall = reports({"code": (32, 0.2, 0.02)}, lossless=False)
    assert not gate(champ, chall).promote
    empty = gate(champ, {"lossless": True, "records": {}, "domains": {}})
    assert not empty.promote
    assert empty.reasons == ["not enough evidence: 0 paired held-out records, the gate needs 16"]


def test_only_records_both_drafters_served_are_paired():
    champ, chall = reports({"code": (20, 0.1, 0.02)})
    del chall["records"]["code-0"]
    champ["records"]["extra"] = {"domain": "code", "tau_full": 9.0, "tau": 9.0}
    assert gate(champ, chall).interval("tau_full").n == 19


def test_paired_bootstrap_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(1)
    diffs = rng.normal(0.05, 0.2, 64)
    a = paired_bootstrap(diffs, 2000, 0.95, seed=0)
    assert a == paired_bootstrap(diffs, 2000, 0.95, seed=0)
    assert a != paired_bootstrap(diffs, 2000, 0.95, seed=1)
    mean, low, high = a
    assert mean == pytest.approx(diffs.mean())
    # Percentile interval of a mean: close to ±1.96 standard errors.
    se = diffs.std(ddof=1) / np.sqrt(len(diffs))
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert paired_bootstrap(np.full(10, 0.1), 500, 0.9, seed=0) == pytest.approx((0.1, 0.1, 0.1))


def test_policy_refuses_a_metric_without_per_record_values():
    with pytest.raises(ValueError, match="gate metric must be one of tau_full, tau"):
        GatePolicy(metric="tps")


def test_the_report_carries_intervals_counts_and_the_reason():
    champ, chall = reports({"code": (24, 0.1, 0.03), "math": (8, 0.1, 0.03)})
    keys = ("tau", "tau_full", "mean_verify_len", "tps", "tokens_per_cpu_s")
    for rep in (champ, chall):
        rep["domains"] = {d: dict.fromkeys(keys, 1.0) for d in ("all", "code", "math")}
    shadow = ShadowReport(champ, chall, gate(champ, chall))
    out = shadow.to_dict()["gate"]
    assert out["promote"] and out["reasons"] and out["policy"]["resamples"] == 2000
    summary = gate_summary(out)
    assert summary["decision"] == {"promote": 1.0}
    assert summary["tau_full.all"]["n"] == 32 and summary["tau_full.math"]["n"] == 8
    m = shadow.metrics()
    assert m["gate.tau_full.all.low"] > 0 and m["gate.tau_full.code.n"] == 24


def test_the_demo_shows_a_rejection_plainly_with_its_evidence():
    """`make demo` never overrides the gate: a reject is printed with its reasons and intervals."""
    from rich.console import Console

    from adaflash.ops.demo import gate_table, rejection_text

    champ, chall = reports({"code": (24, 0.0, 0.1), "chat": (8, -0.15, 0.02)})
    d = gate(champ, chall).to_dict()
    assert not d["promote"]
    console = Console(record=True, width=200)
    console.print(gate_table(d, "2", "1"))
    console.print(rejection_text(d, "2", "1"))
    text = console.export_text()
    assert "shadow gate: v2 vs v1 on the same held-out records (95% paired bootstrap, 2000 resamples" in text
    assert "the gate rejected v2; v1 stays champion" in text
    assert "domain chat regresses" in text and "regresses" in text.split("the gate rejected")[0]
    assert "tau (guard)" in text and "The demo does not override the gate" in text
    assert "registry promote 2 --override-gate" in text
    for iv in d["intervals"]:  # every interval is on screen, with its record count
        assert f"[{iv['low']:+.3f}, {iv['high']:+.3f}]" in text
