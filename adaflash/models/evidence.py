"""A drafter's release evidence: its measured full-block acceptance on held-out text.

A drafter carries it in `adaflash.json` (`DrafterMeta.acceptance`): the survival curve
S_j = P(at least j drafts accepted), j = 1..block−1, the verify rounds behind it, and where it was
measured (the bootstrap's held-out split, the pipeline's shadow evaluation, ...). Serving prices a
freshly installed drafter by it (`CostPolicy`) instead of one generic prior: a retrained drafter
at τ 2.5 and the bootstrap at τ 1.5 are not the same bet, and a policy that starts both at the
same pessimistic prior explores the good one too rarely to find out within a short session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise

from adaflash.errors import CheckpointError


@dataclass(frozen=True)
class AcceptanceEvidence:
    survival: list[float]  # S_j, non-increasing, in [0, 1]
    rounds: int | None  # full-block verify rounds it was measured over (None: not recorded)
    source: str  # what measured it, for a reader of the checkpoint

    @property
    def tau(self) -> float:
        """The full-block τ it implies: 1 + Σ S_j."""
        return 1.0 + sum(self.survival)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, raw: object, where: str) -> AcceptanceEvidence:
        """From `adaflash.json`'s `acceptance`; a one-line CheckpointError when malformed."""
        try:
            assert isinstance(raw, dict)
            surv = [float(s) for s in raw["survival"]]
            rounds = None if raw.get("rounds") is None else int(raw["rounds"])
            source = str(raw.get("source", ""))
        except (AssertionError, KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{where}: acceptance must be {{survival: [floats], rounds: int | null, source: str}}"
            ) from None
        if not surv or any(not 0.0 <= s <= 1.0 for s in surv) or any(b > a for a, b in pairwise(surv)):
            raise CheckpointError(f"{where}: acceptance survival must be non-increasing values in [0, 1]")
        if rounds is not None and rounds < 0:
            raise CheckpointError(f"{where}: acceptance rounds must be >= 0")
        return cls(surv, rounds, source)

    @classmethod
    def from_positions(cls, rates: Sequence[float], rounds: int | None, source: str) -> AcceptanceEvidence:
        """From per-position acceptance rates as `evaluate_acceptance` reports them (the share of
        rounds whose position j was accepted: already a survival curve), made non-increasing."""
        out, prev = [], 1.0
        for r in rates:
            prev = min(prev, max(float(r), 0.0))
            out.append(round(prev, 4))
        return cls(out, rounds, source)

    @classmethod
    def of(cls, row: dict, source: str) -> AcceptanceEvidence:
        """From one group's row of `evaluate_acceptance` (its per-position rates and rounds)."""
        return cls.from_positions(row["accept_rate_by_position"], row.get("dflash_rounds"), source)

    @classmethod
    def from_tau(cls, tau: float, positions: int, rounds: int, source: str) -> AcceptanceEvidence:
        """From a full-block τ alone (a shadow evaluation's `tau_full`): the geometric curve
        S_j = c^j whose Σ S_j is τ − 1 (constant conditional acceptance c)."""
        want = min(max(tau - 1.0, 0.0), positions * 0.999)
        lo, hi = 0.0, 1.0
        for _ in range(50):  # Σ c^j is increasing in c: bisection
            c = (lo + hi) / 2
            lo, hi = (c, hi) if sum(c**j for j in range(1, positions + 1)) < want else (lo, c)
        c = (lo + hi) / 2
        return cls([round(c**j, 4) for j in range(1, positions + 1)], rounds, source)
