"""The shadow gate: promote a challenger only on evidence, never on one lucky number.

Both drafters serve the same held-out records, so the comparison is paired: for every record,
d = τ(challenger) − τ(champion). The gate resamples the records with replacement (a seeded
paired bootstrap, 2,000 resamples by default) and reads a confidence interval of the mean d,
overall and per domain:

  promote  when the overall interval's lower bound is above `min_gain` (τ units: tokens per
           round; 0 means "better, with the stated confidence"), the outputs are lossless, there
           are at least `min_records` paired records, and no domain really regresses;
  regress  a domain whose interval lies wholly below −`max_domain_regression` — a drop the
           records cannot explain by chance. A domain with fewer than `min_domain_records`
           records cannot veto on its own (its interval is as wide as its luck); it still
           counts in the overall interval.

When the metric is the full-block τ, the served τ (what k̂ lets through) is guarded the same
way, overall and per domain: a better drafter whose head verifies worse is not a win. A reject
says which rule failed: "not enough evidence" (the interval straddles the bar), "worse" (it lies
below zero), or the domain that regressed. Serving throughput is measured on the engine and
reported beside the intervals, but not gated on: under continuous batching there is no
per-record TPS to pair, and on a shared CPU a wall-clock TPS measures the neighbours too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

GATE_METRICS = ("tau_full", "tau")  # what GatePolicy.metric may name: per-record τ, pairable
GATE_MODES = ("auto", "manual")  # manual: a winner waits, pending approval, for a person
GUARD = "tau"  # served τ: guarded against regression when the gate metric is another one


@dataclass(frozen=True)
class GatePolicy:
    # "tau_full": acceptance over the full block (uncensored, DESIGN §1) — the drafter's quality
    # even while the length head still verifies k̂ = 1 and the served τ cannot move yet; the served
    # τ is then guarded. "tau" gates on the served τ directly.
    metric: str = "tau_full"
    min_gain: float = 0.0  # the overall interval's lower bound must exceed this (tokens per round)
    max_domain_regression: float = 0.02  # tolerance: an upper bound below −this is a regression
    confidence: float = 0.95
    resamples: int = 2000
    seed: int = 0
    min_records: int = 16  # fewer paired held-out records: not enough evidence, whatever they say
    min_domain_records: int = 5  # fewer: the domain's interval is reported but cannot veto

    def __post_init__(self) -> None:
        if self.metric not in GATE_METRICS:
            raise ValueError(f"gate metric must be one of {', '.join(GATE_METRICS)}, not {self.metric!r}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"gate confidence must be in (0, 1), not {self.confidence}")
        if self.resamples < 100:
            raise ValueError(f"a bootstrap needs at least 100 resamples, not {self.resamples}")


@dataclass(frozen=True)
class Interval:
    """The paired bootstrap interval of one metric's mean per-record difference on one domain."""

    metric: str
    domain: str
    n: int  # paired held-out records
    champion: float  # mean per-record value
    challenger: float
    gain: float  # mean of challenger − champion
    low: float
    high: float

    def text(self) -> str:
        return (
            f"{self.metric} {self.domain}: Δ {self.gain:+.3f} [{self.low:+.3f}, {self.high:+.3f}] "
            f"({self.champion:.3f} → {self.challenger:.3f}, {self.n} records)"
        )


@dataclass
class GateDecision:
    promote: bool
    reasons: list[str] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    policy: GatePolicy = field(default_factory=GatePolicy)

    def to_dict(self) -> dict:
        return asdict(self)

    def interval(self, metric: str, domain: str = "all") -> Interval | None:
        return next((i for i in self.intervals if i.metric == metric and i.domain == domain), None)


def paired_bootstrap(
    diffs: np.ndarray, resamples: int, confidence: float, seed: int
) -> tuple[float, float, float]:
    """(mean, low, high): the percentile interval of the mean of `diffs` under resampling."""
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), (resamples, len(diffs)))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(diffs.mean()), float(low), float(high)


def intervals(champion: dict, challenger: dict, metric: str, policy: GatePolicy) -> list[Interval]:
    """One interval per domain (and "all") over the records both reports served."""
    old, new = champion["records"], challenger["records"]
    paired = sorted(set(old) & set(new))
    by_domain: dict[str, list[str]] = {"all": paired}
    for rid in paired:
        by_domain.setdefault(new[rid]["domain"], []).append(rid)
    out = []
    for dom, rids in sorted(by_domain.items(), key=lambda kv: (kv[0] != "all", kv[0])):
        if not rids:
            continue
        a = np.array([old[r][metric] for r in rids], dtype=float)
        b = np.array([new[r][metric] for r in rids], dtype=float)
        gain, low, high = paired_bootstrap(b - a, policy.resamples, policy.confidence, policy.seed)
        out.append(Interval(metric, dom, len(rids), float(a.mean()), float(b.mean()), gain, low, high))
    return out


def gate(champion: dict, challenger: dict, policy: GatePolicy = GatePolicy()) -> GateDecision:
    """Decide on two `shadow_eval` reports of the same held-out records (each with per-record
    values under "records")."""
    reasons = []
    if not challenger.get("lossless", False):
        reasons.append("challenger outputs differ from the target's greedy outputs")
    m, conf = policy.metric, f"{policy.confidence:.0%}"
    evidence = [iv for k in dict.fromkeys((m, GUARD)) for iv in intervals(champion, challenger, k, policy)]
    overall = next((iv for iv in evidence if iv.metric == m and iv.domain == "all"), None)
    n = overall.n if overall else 0
    if n < policy.min_records:
        need = policy.min_records
        reasons.append(f"not enough evidence: {n} paired held-out records, the gate needs {need}")
    if overall is None:
        return GateDecision(False, reasons, evidence, policy)
    if overall.low <= policy.min_gain:
        if overall.high < 0:
            why = f"the challenger is worse ({conf} interval below 0)"
        else:
            bar = f"{policy.min_gain:+.3f}"
            why = f"not enough evidence: the {conf} interval's lower bound is not above {bar}"
        reasons.append(f"{why}: {overall.text()}")
    for iv in evidence:
        if iv is overall or (iv.domain != "all" and iv.n < policy.min_domain_records):
            continue
        if iv.high < -policy.max_domain_regression:
            reasons.append(
                f"domain {iv.domain} regresses: {iv.text()}, {conf} interval wholly below "
                f"−{policy.max_domain_regression:.3f}"
            )
    if reasons:
        return GateDecision(False, reasons, evidence, policy)
    tol = policy.max_domain_regression
    guard = "" if m == GUARD else f"; served τ not worse ({GUARD} upper bounds ≥ −{tol:.3f})"
    why = (
        f"{overall.text()}: {conf} paired bootstrap ({policy.resamples} resamples), lower bound above "
        f"{policy.min_gain:+.3f}; no domain regresses{guard}"
    )
    return GateDecision(True, [why], evidence, policy)
