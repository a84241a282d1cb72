"""Acceptance as the cost policy learns it: per proposer, the conditional acceptance of each draft
position (`AcceptanceStats`, seeded from a drafter's release evidence where it has one), and how far
a proposer's own estimates hold (`Reliability`, per bin of the estimate). `costs.py` prices the
choices these feed; `policy.py` owns one of each per proposer and source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """P(draft position j accepted | positions < j accepted), per position, decayed counts: a
    truncated verify (k̂ < k) is censored correctly because position j only counts when tried."""

    positions: int
    prior: float = 0.3
    prior_weight: float = 2.0
    decay: float = 0.999
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    # Per-position priors (conditionals), where evidence gives them: a drafter's release evidence
    # (`from_survival`) instead of the one generic `prior`.
    priors: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.positions
        self.accepted = [0.0] * self.positions
        self.priors = (list(self.priors) + [self.prior] * self.positions)[: self.positions]

    @classmethod
    def from_survival(cls, positions: int, survival: Sequence[float], weight: float) -> AcceptanceStats:
        """Stats whose prior is a measured survival curve (S_j = P(at least j drafts accepted)),
        held with `weight` tries per position: the conditionals S_j / S_{j−1}, kept inside
        [0.02, 0.98] (a few hundred held-out rounds never prove a position certain or hopeless),
        deeper positions than measured repeating the last one."""
        cond, prev = [], 1.0
        for s in survival[:positions]:
            cond.append(min(max(s / prev if prev > 0 else 0.0, 0.02), 0.98))
            prev = s
        cond += cond[-1:] * (positions - len(cond)) if cond else []
        return cls(positions, prior=cond[0] if cond else 0.3, prior_weight=weight, priors=cond)

    def observe(self, drafted: int, accepted: int) -> None:
        for j in range(self.positions):
            self.tried[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(min(accepted + 1, drafted, self.positions)):
            self.tried[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0

    def conditional(self) -> list[float]:
        w = self.prior_weight
        return [
            (a + p * w) / (t + w) if t + w > 0 else p
            for a, t, p in zip(self.accepted, self.tried, self.priors, strict=True)
        ]

    def survival(self) -> list[float]:
        """S_j = P(at least j drafts accepted), j = 1..positions."""
        out, s = [], 1.0
        for a in self.conditional():
            s *= a
            out.append(s)
        return out


EDGES = (0.2, 0.4, 0.6, 0.8, 0.9)  # estimate bins of a `Reliability` table


@dataclass
class Reliability:
    """How far a proposer's own estimates hold: per bin of the estimate, the decayed sums of
    outcomes and of estimates over every draft position whose outcome verification told (a
    reliability curve, not one factor). A suffix draft estimates P(the first j drafts are all
    accepted) from how its matching occurrences agree; a long history of weak cross-request
    matches can be over-confident at 0.3 and right at 0.95, and one factor for both would either
    price the good matches out or the weak ones in. Each bin starts from `prior` × its estimates
    (`prior_weight` estimate-units)."""

    prior: float = 0.8
    prior_weight: float = 4.0
    decay: float = 0.99
    hits: list[float] = field(default_factory=lambda: [0.0] * (len(EDGES) + 1))
    estimated: list[float] = field(default_factory=lambda: [0.0] * (len(EDGES) + 1))

    @staticmethod
    def bin(p: float) -> int:
        return sum(p >= e for e in EDGES)

    def observe(self, probs: Sequence[float], known: int, hits: int) -> None:
        """The outcome of the first `known` positions of an estimated draft: positions below
        `hits` were accepted, the rest (of those known) were not."""
        for b in range(len(self.hits)):
            self.hits[b] *= self.decay
            self.estimated[b] *= self.decay
        for j, p in enumerate(probs[:known]):
            b = self.bin(p)
            self.hits[b] += float(j < hits)
            self.estimated[b] += p

    def factor(self, p: float) -> float:
        """Measured hits / estimated for estimates like `p`, between 0.05 and 1.5."""
        b = self.bin(p)
        w = self.prior_weight
        return max(0.05, min(1.5, (self.hits[b] + self.prior * w) / (self.estimated[b] + w)))

    def survival(self, probs: Sequence[float]) -> list[float]:
        """The calibrated survival curve of a draft: each estimate times its bin's factor, then
        non-increasing (a deeper position is never likelier than a shallower one)."""
        out, prev = [], 1.0
        for p in probs:
            prev = min(prev, p * self.factor(p), 1.0)
            out.append(prev)
        return out
