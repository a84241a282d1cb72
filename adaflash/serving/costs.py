"""The measured cost model and acceptance statistics behind `adaflash-cost`'s choices.

Per step the policy picks, for each request, a proposer (the drafter, n-gram prompt lookup, or
none: an AR round) and how many drafts to verify, to maximise the expected committed tokens per
second of the whole step:

    tokens(choice) / [target(rows) + drafter_block(R) + drafter_lm(rows_d) + overhead]

The costs are curves measured on this engine (`CostCurve`: calibrated once, then updated by every
step); the expected tokens come from acceptance measured online (`acceptance.AcceptanceStats`: conditional
acceptance per draft position, per proposer) scaled per request (its own n-gram hit rate, the
length head's â for the drafter). The ratio objective is maximised by Dinkelbach iterations: with
λ the best tokens/second so far, each request independently maximises
`E[tokens] − λ·marginal seconds`; the drafter's fixed cost is charged by comparing the plan with
and without a drafter forward on exact costs. Losslessness never depends on these choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PROPOSERS = ("drafter", "ngram", "suffix")
MARGIN = 0.05  # expected gain over the no-draft plan below which `choose` does not speculate


class CostCurve:
    """Seconds as a function of a size (packed rows, drafted requests): piecewise linear over
    knots at powers of two, each knot nudged towards every observation by its interpolation
    weight (an online least-squares step on the interpolated prediction)."""

    def __init__(self, max_size: int = 1024, rate: float = 0.25) -> None:
        self.knots = [0] + [2**i for i in range(int(math.log2(max_size)) + 1)]
        self.values: list[float | None] = [None] * len(self.knots)
        self.values[0] = 0.0
        self.measured = {0}  # knots set by calibration; the others are interpolated from them
        self.rate = rate

    def _bracket(self, size: float) -> tuple[int, int, float]:
        ks = self.knots
        if size >= ks[-1]:
            return len(ks) - 2, len(ks) - 1, (size - ks[-2]) / (ks[-1] - ks[-2])
        hi = next(i for i, k in enumerate(ks) if k >= size)
        lo = max(hi - 1, 0)
        w = 0.0 if hi == lo else (size - ks[lo]) / (ks[hi] - ks[lo])
        return lo, hi, w

    def set(self, size: int, seconds: float) -> None:
        """A calibration point; knots without one are interpolated from their neighbours."""
        lo, hi, w = self._bracket(size)
        j = hi if w > 0.5 else lo
        self.values[j] = seconds
        self.measured.add(j)
        known = [(self.knots[i], self.values[i]) for i in sorted(self.measured)]
        for i, k in enumerate(self.knots):
            if i not in self.measured:
                self.values[i] = _interp(known, k)

    def make_monotone(self) -> None:
        """Pool adjacent violators: more rows never cost less (calibration noise can say so)."""
        blocks: list[list[float]] = []  # [sum, count]
        for v in self.values:
            blocks.append([v or 0.0, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        self.values = [s / c for s, c in blocks for _ in range(int(c))]

    @property
    def ready(self) -> bool:
        return len(self.measured) > 1

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        lo, hi, w = self._bracket(size)
        vl, vh = self.values[lo] or 0.0, self.values[hi] or 0.0
        return max(vl + w * (vh - vl), 0.0)  # w > 1 extrapolates the last segment

    def observe(self, size: float, seconds: float, weight: float = 1.0) -> None:
        if size <= 0 or not math.isfinite(seconds) or weight <= 0:
            return
        if not self.ready:  # never calibrated (e.g. a drafter installed later): start from this
            self.set(int(size), seconds)
            return
        lo, hi, w = self._bracket(size)
        err = seconds - self(size)
        w = min(w, 1.0)
        rate = self.rate * weight
        self.values[lo] += rate * (1 - w) * err if lo else 0.0
        self.values[hi] += rate * w * err


def _interp(known: list[tuple[int, float]], x: int) -> float:
    if x <= known[0][0]:
        return known[0][1]
    for (k0, v0), (k1, v1) in zip(known, known[1:], strict=False):
        if k0 <= x <= k1:
            return v0 + (v1 - v0) * (x - k0) / (k1 - k0)
    (k0, v0), (k1, v1) = known[-2:] if len(known) > 1 else ((0, 0.0), known[-1])
    # Never downhill past the last measured size: a noisy middle probe (slower than the largest)
    # extrapolated a falling line to negative seconds, and pooling in `make_monotone` then
    # pulled a whole range of the curve to zero (a context projection priced as free).
    return v1 + max(v1 - v0, 0.0) * (x - k1) / max(k1 - k0, 1)


def scaled(survival: Sequence[float], first: float) -> list[float]:
    """The survival curve with its first position set to `first` (a request's own hit rate, or
    one derived from â), deeper positions keeping the measured conditionals."""
    if not survival or survival[0] <= 0:
        return [0.0] * len(survival)
    f = max(0.0, min(first, 1.0)) / survival[0]
    return [min(1.0, s * f) for s in survival]


def rescaled(survival: Sequence[float], ratio: float) -> list[float]:
    """The survival curve scaled so that its expected accepted drafts are `ratio` times the
    measured ones (clipped at 1 per position). The drafter's per-request signal is â relative to
    the mean â: a biased head still orders requests, the measured acceptance sets the level."""
    target = max(0.0, ratio) * sum(survival)
    if target <= 0 or not survival or survival[0] <= 0:
        return [0.0] * len(survival)
    if target >= sum(s > 0 for s in survival):  # every position that can be reached, certain
        return [1.0 if s > 0 else 0.0 for s in survival]
    # Exact, not bisection (it runs per request per step): Σ min(1, c·s_j) is piecewise linear
    # in c. With the m largest entries clipped, c = (target − m) / Σ(the rest); the right m is the
    # one whose c clips exactly those entries.
    order = sorted(survival, reverse=True)
    rest = sum(order)
    for m in range(len(order)):
        if rest <= 0:
            break
        c = (target - m) / rest
        if c * order[m] <= 1.0 and (m == 0 or c * order[m - 1] >= 1.0):
            return [min(1.0, s * c) for s in survival]
        rest -= order[m]
    return [1.0 if s > 0 else 0.0 for s in survival]


@dataclass
class Option:
    proposer: str  # "none" | "ngram" | "suffix" | "drafter"
    drafts: int  # drafts to verify (k̂ − 1)
    expected: float  # expected accepted drafts


def best_length(survival: Sequence[float], limit: int, price: float) -> tuple[int, float]:
    """(drafts m ≤ limit maximising Σ_{j≤m} S_j − price·m, their expected accepted drafts)."""
    best_m, best_v, acc = 0, 0.0, 0.0
    for m in range(1, min(limit, len(survival)) + 1):
        acc += survival[m - 1]
        v = acc - price * m
        if v > best_v:
            best_m, best_v = m, v
    return best_m, sum(survival[:best_m])


@dataclass
class Candidate:
    """One request's choices for this step."""

    ngram_survival: list[float]  # empty: no n-gram match
    ngram_limit: int
    drafter_survival: list[float]  # empty: the drafter is not an option
    drafter_limit: int
    # Other model-free proposers (name -> survival, drafts it proposed): priced like n-gram.
    lookups: dict[str, tuple[list[float], int]] = field(default_factory=dict)
    # Seconds of one-off work a drafter round of this request pays first (projecting its queued
    # context rows), the share this round is charged (`CostPolicy._setup`).
    drafter_setup: float = 0.0

    def model_free(self) -> list[tuple[str, list[float], int]]:
        return [("ngram", self.ngram_survival, self.ngram_limit)] + [
            (name, surv, limit) for name, (surv, limit) in self.lookups.items()
        ]

    def survival(self, proposer: str) -> list[float]:
        if proposer == "drafter":
            return self.drafter_survival
        return next((s for name, s, _ in self.model_free() if name == proposer), [])


class TargetCost:
    """Seconds of the packed target forward as a function of its rows *and* of the requests
    they belong to: one `CostCurve` over rows per power-of-two request count, interpolated
    between. Why two dimensions: the same 32 rows cost 191 ms as one request's 32-token verify
    and 269 ms as 32 requests' decode tokens (each attends over its own context; measured,
    SmolLM2 fp32, 250-token contexts, CPU time); priced by rows alone, a batch-32 step's extra
    verify rows looked 40-60% cheaper than they are, and drafting lost to AR."""

    def __init__(self, max_rows: int = 2048, max_requests: int = 1, rate: float = 0.25) -> None:
        self.levels = [2**i for i in range(int(math.log2(max(max_requests, 1))) + 1)]
        self.curves = [CostCurve(max_rows, rate) for _ in self.levels]

    @classmethod
    def single(cls, curve: CostCurve) -> TargetCost:
        """One curve for every request count (tests; a rows-only model)."""
        cost = cls(max_requests=1)
        cost.curves = [curve]
        return cost

    @property
    def rate(self) -> float:
        return self.curves[0].rate

    @rate.setter
    def rate(self, value: float) -> None:
        for c in self.curves:
            c.rate = value

    def _bracket(self, requests: float, ready: bool = False) -> tuple[int, int, float]:
        """Levels around `requests` (only measured ones if `ready`) and the weight of the upper
        one, linear in log2(requests)."""
        x = math.log2(min(max(requests, 1.0), self.levels[-1]))
        idx = [i for i, c in enumerate(self.curves) if c.ready] if ready else list(range(len(self.levels)))
        if not idx:
            return 0, 0, 0.0
        lo = max((i for i in idx if i <= x), default=idx[0])
        hi = min((i for i in idx if i >= x), default=idx[-1])
        return lo, hi, (x - lo) / (hi - lo) if hi > lo else 0.0

    def __call__(self, rows: float, requests: float = 1.0) -> float:
        lo, hi, w = self._bracket(requests, ready=True)
        if not self.curves[lo].ready:
            return 0.0
        return (1 - w) * self.curves[lo](rows) + w * self.curves[hi](rows)

    def set(self, requests: int, rows: int, seconds: float) -> None:
        """A calibration point; `requests` must be one of `levels`."""
        self.curves[self.levels.index(requests)].set(rows, seconds)

    def observe(self, rows: float, requests: float, seconds: float) -> None:
        lo, hi, w = self._bracket(requests)
        self.curves[lo].observe(rows, seconds, 1 - w)
        if hi != lo:
            self.curves[hi].observe(rows, seconds, w)

    def make_monotone(self) -> None:
        for c in self.curves:
            c.make_monotone()


@dataclass
class StepCosts:
    target: TargetCost
    drafter_block: CostCurve
    drafter_lm: CostCurve
    overhead: float = 0.0
    # The drafter's context projection by rows: paid once per committed row, when its request
    # next drafts (`DrafterSlots`), so it is priced per request (`Candidate.drafter_setup`).
    drafter_context: CostCurve = field(default_factory=lambda: CostCurve(4096))

    def seconds(
        self, rows: int, drafted: int, lm_rows: int, fixed_drafted: int = 0, requests: float = 1.0
    ) -> float:
        block = self.drafter_block(fixed_drafted + drafted) if drafted + fixed_drafted else 0.0
        return self.target(rows, requests) + block + self.drafter_lm(lm_rows) + self.overhead


def plan_seconds(
    costs: StepCosts,
    opts: Sequence[Option],
    base_rows: int,
    fixed_drafted: int,
    penalty: float,
    requests: float,
) -> float:
    """Expected seconds of a step running `opts` on top of its base work: every cost a draft adds
    is scaled by the guard's `penalty` (see `choose`)."""
    base_sec = costs.seconds(base_rows, 0, 0, fixed_drafted, requests)
    rows = base_rows + sum(o.drafts for o in opts)
    drafted = sum(o.proposer == "drafter" for o in opts)
    lm = sum(o.drafts for o in opts if o.proposer == "drafter")
    return base_sec + penalty * (costs.seconds(rows, drafted, lm, fixed_drafted, requests) - base_sec)


def lockstep_gain(survivals: Sequence[Sequence[float]]) -> float:
    """Expected steps a lockstep batch saves in one step: E[min_i accepted_i] over requests that
    draft independently, Σ_j Π_i S_i(j) (request i's survival truncated to its drafts). Eight
    requests that each accept a first draft with p = 0.6 save 0.6^8 ≈ 0.02 steps, not 0.6."""
    if not survivals:
        return 0.0
    return sum(math.prod(s[j] for s in survivals) for j in range(min(len(s) for s in survivals)))


def choose(
    cands: Sequence[Candidate],
    costs: StepCosts,
    base_rows: int,
    base_tokens: float,
    fixed_drafted: int = 0,
    iterations: int = 3,
    penalty: float = 1.0,
    requests: float = 1.0,
) -> tuple[list[Option], float]:
    """Per candidate the option maximising the step's expected tokens per second (see module
    docstring). `base_rows`/`base_tokens`: what the step does regardless (prefills, other
    methods' verifies, one token per decoding request); `fixed_drafted`: requests of other
    methods that run the drafter anyway (its fixed cost is then already paid). Also returns the
    expected tokens/second of the chosen plan (λ, the price of a second). `penalty` ≥ 1 scales
    every cost a draft adds: the realised-throughput guard (`SpeculationGuard`) raises it while
    speculative steps deliver less than plain ones. `requests`: the step's segments (the target
    cost depends on them as well as on rows, `TargetCost`)."""
    n = len(cands)
    none = [Option("none", 0, 0.0)] * n

    def total(opts: list[Option]) -> float:
        sec = plan_seconds(costs, opts, base_rows, fixed_drafted, penalty, requests)
        return (base_tokens + sum(o.expected for o in opts)) / max(sec, 1e-9)

    best, best_rate = none, total(none)
    lam = best_rate
    for _ in range(iterations):
        extra = max(sum(o.drafts for o in best), n)
        row_price = costs.target(base_rows + extra, requests) - costs.target(base_rows, requests)
        row_price *= penalty / extra
        lm_price = penalty * costs.drafter_lm(max(extra, 1)) / max(extra, 1)
        per_draft = costs.drafter_block(fixed_drafted + n) - costs.drafter_block(fixed_drafted)
        per_draft *= penalty / max(n, 1)
        for allow_drafter in (False, True):
            opts = []
            for c in cands:
                o = _pick(c, lam, row_price, lm_price, per_draft if allow_drafter else None)
                opts.append(o)
            rate = total(opts)
            # Speculation must promise a clear gain over plain decoding: the costs and acceptance
            # are estimates, and a plan that only breaks even on paper loses on a noisy machine.
            if rate > best_rate * (1 + MARGIN if best is none else 1):
                best, best_rate = opts, rate
        lam = best_rate
    return best, best_rate


@dataclass
class SpeculationGuard:
    """Never lose to plain decoding, whatever the cost model believes: per concurrency bucket, the
    tokens/second that steps with drafts and steps without them really delivered (decayed sums of
    tokens over decayed sums of seconds). While drafting delivers less, the price of every draft
    grows ×`step` per speculative step (up to `max_penalty`); while it delivers more, it shrinks
    ÷`step` back to the model's. Pure plain steps are forced now and then (`ar_every`) so the
    comparison stays current.

    Why sums and one step size: a speculative step at C = 1 commits 1 token or several, so its
    own rate is bimodal. An EMA of per-step rates (rate 0.2) crossed below plain decoding on
    many steps of a drafter that won on average, and with ×1.5 up against ÷1.1 down the price
    rose unless drafting won > 81% of comparisons: measured, a 2-prompt C = 1 cell ran 55 of 79
    rounds plain with its best drafter of the run."""

    # ×1.3 per losing speculative step: a 48-token burst at C = 8 is ~50 steps, and the price
    # must triple within a few of them while every one loses to plain decoding.
    step: float = 1.3
    max_penalty: float = 20.0
    # Each plain step lets the price drift back ÷1.02 (20× → 1× in ~150 steps): a price that
    # only speculative steps could lower would lock drafting out for good once a bad spell (or a
    # harder domain earlier in the same load bucket) has raised it: chat at C = 1 then drafts
    # nothing after code's cells max the bucket's price, though n-gram alone gains 1.23× there.
    idle_decay: float = 1.02
    ar_every: int = 48
    rate: float = 0.1  # decay of the token and second sums: ~10 steps of memory per kind
    buckets: dict[int, dict[str, float]] = field(default_factory=dict)

    @staticmethod
    def bucket(requests: int) -> int:
        return min(int(math.log2(max(requests, 1))), 6)

    def state(self, requests: int) -> dict[str, float]:
        return self.buckets.setdefault(self.bucket(requests), {"penalty": 1.0, "since_ar": 0.0})

    def penalty(self, requests: int) -> float:
        return self.state(requests)["penalty"]

    def want_plain_step(self, requests: int) -> bool:
        b = self.state(requests)
        return "ar" not in b or b["since_ar"] >= self.ar_every

    def observe(self, requests: int, tokens: int, seconds: float, speculated: bool) -> None:
        if seconds <= 0 or requests <= 0:
            return
        b = self.state(requests)
        key = "spec" if speculated else "ar"
        keep = 1 - self.rate if key in b else 0.0
        b[key + "_tokens"] = keep * b.get(key + "_tokens", 0.0) + tokens
        b[key + "_seconds"] = keep * b.get(key + "_seconds", 0.0) + seconds
        b[key] = b[key + "_tokens"] / b[key + "_seconds"]
        if not speculated:
            b["since_ar"] = 0.0
            b["penalty"] = max(b["penalty"] / self.idle_decay, 1.0)
            return
        b["since_ar"] += 1
        if "ar" in b:
            if b["spec"] < b["ar"]:
                b["penalty"] = min(b["penalty"] * self.step, self.max_penalty)
            else:
                b["penalty"] = max(b["penalty"] / self.step, 1.0)


def _pick(c: Candidate, lam: float, row_price: float, lm_price: float, per_draft: float | None) -> Option:
    best, best_v = Option("none", 0, 0.0), 0.0
    for name, survival, limit in c.model_free():  # no forward: only the verify rows cost
        if not survival:
            continue
        m, expected = best_length(survival, limit, lam * row_price)
        v = expected - lam * row_price * m
        if m and v > best_v:
            best, best_v = Option(name, m, expected), v
    if per_draft is not None and c.drafter_survival:
        price = lam * (row_price + lm_price)
        m, expected = best_length(c.drafter_survival, c.drafter_limit, price)
        v = expected - price * m - lam * (per_draft + c.drafter_setup)
        if m and v > best_v:
            best = Option("drafter", m, expected)
    return best
