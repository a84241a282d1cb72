"""The replay window: which earlier clean records a training round replays beside the new ones.

Why: a round that trains on its own 16 new records only forgets what the previous rounds taught
(without replay, `adaflash adapt` plateaus at +6% full-block τ after one round). A bounded window
of earlier records, weighted towards the recent ones and capped per tenant, keeps the drafter on
the current traffic mix without letting one chatty tenant (or one old burst) decide what it
learns.

Selection is a seeded weighted sample without replacement (Efraimidis–Spirakis keys
u^(1/w)): a record `age` seconds older than the newest candidate has weight 2^(−age/half_life).
Each tenant gets at most `tenant_cap` of the window (at least one record). The same inputs and
seed give the same window, so lineage can name it and a rerun reproduces it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from adaflash.feedback.schema import CleanRecord


@dataclass(frozen=True)
class ReplayWindow:
    max_records: int = 0  # earlier records replayed per round; 0: new records only
    half_life_s: float = 3600.0  # recency: weight halves for every half_life_s of age
    tenant_cap: float = 0.5  # at most this share of the window per tenant

    def __post_init__(self) -> None:
        if self.max_records < 0:
            raise ValueError(f"max_records must be >= 0, got {self.max_records}")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")
        if not 0 < self.tenant_cap <= 1:
            raise ValueError(f"tenant_cap must be in (0, 1], got {self.tenant_cap}")

    @property
    def per_tenant(self) -> int:
        return max(1, math.floor(self.max_records * self.tenant_cap))


def replay_sample(
    candidates: list[CleanRecord], window: ReplayWindow, seed: int = 0, exclude: set[str] | None = None
) -> list[CleanRecord]:
    """Up to `window.max_records` of `candidates` (earlier clean records), recency-weighted and
    capped per tenant; records whose id is in `exclude` (this round's own) are never replayed.
    Returned in record-id order."""
    exclude = exclude or set()
    pool = {c.record.record_id: c for c in candidates if c.record.record_id not in exclude}
    if window.max_records == 0 or not pool:
        return []
    records = sorted(pool.values(), key=lambda c: c.record.record_id)
    newest = max(c.record.created_at for c in records)
    rng = random.Random(seed)

    def key(c: CleanRecord) -> float:
        age = max(0.0, (newest - c.record.created_at).total_seconds())
        weight = 2.0 ** (-age / window.half_life_s)
        # log of u^(1/w), so that weights down to ~1e-300 still order correctly.
        return math.log(max(rng.random(), 1e-300)) / max(weight, 1e-300)

    ranked = sorted(records, key=key, reverse=True)
    taken: list[CleanRecord] = []
    per_tenant: Counter[str] = Counter()
    for c in ranked:
        tenant = c.record.tenant_id or ""
        if per_tenant[tenant] >= window.per_tenant:
            continue
        per_tenant[tenant] += 1
        taken.append(c)
        if len(taken) == window.max_records:
            break
    return sorted(taken, key=lambda c: c.record.record_id)
