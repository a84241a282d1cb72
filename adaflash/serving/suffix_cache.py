"""The fast learner: per-tenant suffix indexes over governed responses (`models/suffix.py`).

Fed only by `adaflash.feedback.clean` (`suffix_feed.py`): a response enters the cache after
governance scrubbed and validated it and only if its tenant consented, so the cache never holds
what governance removed, and a tenant opted out of training is never learned from.

Isolation: a request looks only in its own tenant's index. A cross-tenant index is opt-in
(`cross_tenant`): with it, whether a request is served faster tells its client that some other
tenant's responses contained its continuation — a timing channel across tenants.

Bounded: a cap on tokens per tenant and in all; the least recently used response goes first
(used = added, or a proposal drawn from it). Thread-safe: the feed thread adds while the engine's
step loop proposes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from adaflash.models.suffix import Draft, SuffixConfig, SuffixIndex

GLOBAL = "*"  # the cross-tenant index's name (opt-in)
# Bytes per stored token, measured with tracemalloc: 701k tokens of user turns from the tools,
# sql and edit sets in 4 tenants took 80.4 MB (115 B/token: the token array, one index entry,
# the gram tuples and lists). What `/health` and `/metrics` report as memory.
BYTES_PER_TOKEN = 115


@dataclass
class SuffixCacheConfig:
    enabled: bool = True
    max_tokens_per_tenant: int = 200_000
    max_tokens: int = 1_000_000
    cross_tenant: bool = False  # opt-in: one index over every tenant's responses (see module doc)
    min_tokens: int = 4  # shorter responses teach nothing worth an entry
    index: SuffixConfig = field(default_factory=SuffixConfig)


@dataclass
class CacheStats:
    tenants: int
    responses: int
    tokens: int
    bytes: int
    added: int
    evicted: int
    skipped: dict[str, int]
    last_offsets: dict[str, int]  # "topic/partition" -> offset of the last clean record applied

    def as_dict(self) -> dict:
        return {
            "tenants": self.tenants,
            "responses": self.responses,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "added": self.added,
            "evicted": self.evicted,
            "skipped": dict(self.skipped),
            "last_offsets": dict(self.last_offsets),
        }


class SuffixCache:
    def __init__(self, config: SuffixCacheConfig | None = None) -> None:
        self.config = config or SuffixCacheConfig()
        self._lock = threading.Lock()
        self._indexes: dict[str, SuffixIndex] = {}
        # LRU over (index name, sequence id) -> tokens; one entry per index a response is in.
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        # The same order per index (sequence id -> tokens): its oldest response in O(1).
        self._lru_of: dict[str, OrderedDict[int, int]] = {}
        self._tokens = 0  # tokens over every index (the global cap's measure)
        self._ids: dict[str, int] = {}  # record id -> sequence id (a replayed record is not added twice)
        self._records: dict[int, str] = {}  # sequence id -> record id (forgotten on eviction)
        self._next = 0
        self.added = self.evicted = 0
        self.skipped: dict[str, int] = {}
        self.last_offsets: dict[str, int] = {}

    # --- learning ---------------------------------------------------------------------------------

    def skip(self, reason: str) -> None:
        with self._lock:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, tenant: str, record_id: str, tokens: Sequence[int], where: str | None = None,
            offset: int | None = None) -> bool:  # fmt: skip
        """Learn one governed response of `tenant`. False when it was not added (a duplicate, too
        short, or the cache is off). `where`/`offset`: the clean record's topic/partition and
        offset, shown by `/health` as the last applied."""
        c = self.config
        with self._lock:
            if where is not None and offset is not None:
                self.last_offsets[where] = max(offset, self.last_offsets.get(where, -1))
            why = "off" if not c.enabled else "duplicate" if record_id in self._ids else None
            why = why or ("short" if len(tokens) < c.min_tokens else None)
            if why:
                self.skipped[why] = self.skipped.get(why, 0) + 1
                return False
            tokens = list(tokens)[: c.max_tokens_per_tenant]
            sid = self._next
            self._next += 1
            self._ids[record_id] = sid
            self._records[sid] = record_id
            for name in (tenant, GLOBAL) if c.cross_tenant else (tenant,):
                self._indexes.setdefault(name, SuffixIndex(c.index)).add(sid, tokens)
                self._lru[(name, sid)] = len(tokens)
                self._lru_of.setdefault(name, OrderedDict())[sid] = len(tokens)
                self._tokens += len(tokens)
            self.added += 1
            self._evict(tenant)
            return True

    def _evict(self, tenant: str) -> None:
        c = self.config
        idx = self._indexes.get(tenant)
        while idx is not None and idx.tokens > c.max_tokens_per_tenant:
            self._drop_oldest_of(tenant)
        while self._tokens > c.max_tokens:
            (name, sid), _ = next(iter(self._lru.items()))
            self._drop(name, sid)

    def _drop_oldest_of(self, name: str) -> None:
        self._drop(name, next(iter(self._lru_of[name])))

    def _drop(self, name: str, sid: int) -> None:
        self._lru.pop((name, sid), None)
        self._tokens -= self._lru_of[name].pop(sid)
        idx = self._indexes[name]
        idx.remove(sid)
        if name != GLOBAL:
            self.evicted += 1
            self._ids.pop(self._records.pop(sid, ""), None)
        if not len(idx):
            del self._indexes[name]
            del self._lru_of[name]

    # --- proposing --------------------------------------------------------------------------------

    def propose(self, tenant: str, context: Sequence[int], limit: int) -> Draft | None:
        """The tenant's best proposal (and the cross-tenant one's, when opted in)."""
        names = (tenant, GLOBAL) if self.config.cross_tenant else (tenant,)
        with self._lock:
            best: tuple[str, Draft] | None = None
            for name in names:
                idx = self._indexes.get(name)
                d = idx.propose(context, limit) if idx is not None else None
                if d is not None and (best is None or d.score > best[1].score):
                    best = (name, d)
            if best is None:
                return None
            for sid in best[1].sources[:4]:  # recently useful: last to be evicted
                if (best[0], sid) in self._lru:
                    self._lru.move_to_end((best[0], sid))
                    self._lru_of[best[0]].move_to_end(sid)
            return best[1]

    # --- what it holds ----------------------------------------------------------------------------

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(n for n in self._indexes if n != GLOBAL)

    def contents(self, tenant: str) -> list[list[int]]:
        """Every response the tenant's index holds (audits and tests read the cache back)."""
        with self._lock:
            idx = self._indexes.get(tenant)
            if idx is None:
                return []
            return [idx.sequence(sid) for sid in self._lru_of[tenant]]

    def stats(self) -> CacheStats:
        with self._lock:
            tokens = self._tokens
            return CacheStats(
                tenants=sum(n != GLOBAL for n in self._indexes),
                responses=sum(len(lru) for name, lru in self._lru_of.items() if name != GLOBAL),
                tokens=tokens,
                bytes=tokens * BYTES_PER_TOKEN,
                added=self.added,
                evicted=self.evicted,
                skipped=dict(self.skipped),
                last_offsets=dict(self.last_offsets),
            )
