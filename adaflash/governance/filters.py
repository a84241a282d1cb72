"""Stateful traffic filters: per-tenant floods and near-duplicate prompt floods (poisoning).

Both count by event time (`created_at`), whatever the arrival order across partitions (issue 13).
The rule is a function of the set of events, not of their order: a record is over the limit when
at least `max` earlier events (by (event time, record id)) of its tenant / similar prompts lie
within the window before it. Consumed in event-time order, exactly those records are flagged.
Out of order, a late event can push records that were already passed over the limit; they
cannot be recalled, so the filter owes one flag per such record and pays it on the next events of
the same tenant / similar prompts. The number flagged is therefore the same in any order (up to
a debt left when no related event follows), and traffic that never exceeds the limit is never
flagged, in any order. Events are kept for the window plus `max_lateness_s` behind the newest
event seen, so a partition that lags that far still meets its predecessors from the others (a
consumer may drain one partition before it starts the next; which partitions exist is not known
here, so no safe watermark can be taken from the ones seen). An event later than that is judged
against what is left: it can only be under-counted, never flagged for records it did not meet.
The service rebuilds the windows from the lineage store on start (replayed in event-time order),
so a restart does not reset them.
"""

from __future__ import annotations

import hashlib
import re
import time
from bisect import bisect_left, bisect_right, insort
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import numpy as np

_WORD = re.compile(r"[a-z]+|0+")


_PRIME = (1 << 31) - 1
_A, _B = np.random.default_rng(20261130).integers(1, _PRIME, size=(2, 64, 1), dtype=np.uint64)


def minhash(text: str, shingle: int = 3) -> tuple[int, ...]:
    """64 MinHash values over word 3-shingles of normalised text (case, digits, punctuation folded).

    The Jaccard similarity of two prompts ≈ the fraction of equal values. Universal hashing
    (a·h + b) mod (2^31 − 1) on 31-bit shingle hashes stays inside uint64 arithmetic.
    """
    words = _WORD.findall(re.sub(r"\d+", "0", text.lower()))
    grams = {" ".join(words[i : i + shingle]) for i in range(max(len(words) - shingle + 1, 1))}
    h = np.array(
        [int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "big") % _PRIME for g in grams],
        dtype=np.uint64,
    )
    return tuple(int(v) for v in ((_A * h[None, :] + _B) % _PRIME).min(axis=1))


def _bounded(ts: float, clock: Callable[[], float], cfg: FilterConfig) -> float:
    """An event time as far as it may move the newest one: a record cannot push the windows'
    pruning horizon past governance's own clock (plus the allowed skew) and empty them."""
    return min(ts, clock() + cfg.max_future_skew_s)


@dataclass(frozen=True)
class FilterConfig:
    flood_window_s: float = 60.0
    flood_max_per_window: int = 120  # per tenant
    dup_window_s: float = 600.0
    dup_max_similar: int = 25  # similar prompts (any tenant) tolerated per window
    dup_min_jaccard: float = (
        0.5  # estimated from 64 MinHashes; 16 LSH bands of 4 find J=0.75 pairs w.p. 99.8%
    )
    max_lateness_s: float = 7200.0  # how far behind the newest event an event may arrive and count
    # How far ahead of governance's own clock a record's created_at may be: further is quarantined
    # as `future`, and no record moves the filters' newest event time past it (issue 32).
    max_future_skew_s: float = 300.0


class FloodFilter:
    """Per-tenant request rate by event time (see the module docstring for the rule)."""

    def __init__(self, cfg: FilterConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self._events: dict[str, list[tuple[float, str]]] = defaultdict(list)  # sorted (ts, tie)
        self._debt: Counter = Counter()
        self._newest = float("-inf")
        self._n = 0

    def _count_before(self, ev: list[tuple[float, str]], key: tuple[float, str]) -> int:
        """Events strictly before `key` and inside its window (ts' > ts - W)."""
        lo = bisect_right(ev, (key[0] - self.cfg.flood_window_s, "\uffff"))
        return bisect_left(ev, key) - lo

    def observe(self, tenant: str, ts: float, tie: str = "") -> bool:
        """Record one request; True when it is over the tenant's rate."""
        ev = self._events[tenant]
        key = (ts, tie)
        limit, w = self.cfg.flood_max_per_window, self.cfg.flood_window_s
        own = self._count_before(ev, key) >= limit
        # Later events inside the window each gain one predecessor; those reaching the limit now
        # should have been flagged: a debt this and the next events of the tenant pay.
        i = bisect_right(ev, key)
        while i < len(ev) and ev[i][0] < ts + w:
            if self._count_before(ev, ev[i]) == limit - 1:
                self._debt[tenant] += 1
            i += 1
        insort(ev, key)
        flagged = own or self._debt[tenant] > 0
        if flagged and not own:
            self._debt[tenant] -= 1
        self._newest = max(self._newest, _bounded(ts, self.clock, self.cfg))
        self._n += 1
        if self._n % 512 == 0:
            self._prune()
        return flagged

    def _prune(self) -> None:
        horizon = self._newest - self.cfg.flood_window_s - self.cfg.max_lateness_s
        for tenant in list(self._events):
            ev = self._events[tenant]
            del ev[: bisect_left(ev, (horizon, ""))]
            if not ev:
                del self._events[tenant]
                self._debt.pop(tenant, None)


@dataclass
class _Sig:
    ts: float
    tie: str
    sig: np.ndarray  # uint32[64]: ~4x smaller than a tuple of ints (windows hold hours of events)
    count: int  # similar events before it inside its window
    owed: bool = False  # reached the limit after it was passed: a similar later event pays for it


class NearDuplicateFilter:
    """Similar prompts (MinHash + LSH) per event-time window (see the module docstring).

    Similarity is not transitive, so the debt is kept on the events that went over the limit
    after they had passed, and only a prompt similar to one of them (within its window) pays it:
    an unrelated prompt is never flagged for another campaign.
    """

    BANDS, ROWS = 16, 4

    def __init__(self, cfg: FilterConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self._bands: list[dict[tuple[int, ...], list[int]]] = [defaultdict(list) for _ in range(self.BANDS)]
        self._events: dict[int, _Sig] = {}
        self._seq = 0
        self._newest = float("-inf")

    def observe(self, sig: tuple[int, ...], ts: float, tie: str = "") -> bool:
        """Record one prompt signature; True when too many similar prompts precede it in the window."""
        w, limit = self.cfg.dup_window_s, self.cfg.dup_max_similar
        need = self.cfg.dup_min_jaccard * len(sig)
        arr = np.asarray(sig, dtype=np.uint32)
        keys = [sig[b * self.ROWS : (b + 1) * self.ROWS] for b in range(self.BANDS)]
        candidates: set[int] = set()
        for band, key in zip(self._bands, keys, strict=True):
            candidates.update(band.get(key, ()))
        me = (ts, tie)
        count = 0
        owed: list[_Sig] = []
        for seq in sorted(candidates):
            o = self._events.get(seq)
            if o is None or abs(o.ts - ts) >= w:
                continue
            if np.count_nonzero(arr == o.sig) < need:
                continue
            if (o.ts, o.tie) < me:
                count += 1
            else:  # a later similar prompt gains a predecessor
                o.count += 1
                if o.count == limit:
                    o.owed = True
            if o.owed:
                owed.append(o)
        flagged = count >= limit
        if not flagged and owed:
            owed[0].owed = False  # this prompt takes the flag the passed one should have had
            flagged = True
        self._seq += 1
        self._events[self._seq] = _Sig(ts, tie, arr, count)
        for band, key in zip(self._bands, keys, strict=True):
            band[key].append(self._seq)
        self._newest = max(self._newest, _bounded(ts, self.clock, self.cfg))
        if self._seq % 512 == 0:
            self._prune()
        return flagged

    def _prune(self) -> None:
        horizon = self._newest - self.cfg.dup_window_s - self.cfg.max_lateness_s
        gone = {k for k, e in self._events.items() if e.ts < horizon}
        if not gone:
            return
        for k in gone:
            del self._events[k]
        for band in self._bands:
            for key in list(band):
                kept = [s for s in band[key] if s not in gone]
                if kept:
                    band[key] = kept
                else:
                    del band[key]


def epoch(dt: datetime) -> float:
    return dt.timestamp()
