"""Prefix reuse: the target K/V of earlier prompts' heads, per tenant (automatic prefix caching).

Why: production prompts repeat their heads (a system prompt, tool definitions, a database schema)
and on this CPU prefill is most of a short answer's latency: BIRD's schemas take 2.1 s of a 3.2 s
request at 64 new tokens, a time no drafting can win back. The cache keeps the K/V of full
`block_tokens` blocks of served prompts (and, where the step captured them, the target features
the drafter's context is projected from); an admitted request copies its longest cached prefix
into its slot and prefills only the rest. It is the second fast learner beside the suffix cache:
it learns in one request what a tenant's prompts share.

Lossless: the fp32 runner computes every row alone (`runner._forward_fused`), so a reused block
holds bit for bit what the request's own prefill would write. Blocks form a trie keyed by (parent
block, tokens): a block is reused only after the very same tokens from position 0.

Privacy: K/V stay in process memory (never on disk; a restart starts empty), and a request sees
only its own tenant's blocks. `cross_tenant` opts into one trie for all tenants: then a fast
first token tells a client that another tenant sent the same prefix (the timing channel vLLM's
`cache_salt` closes). A request without feedback consent reads its tenant's blocks but adds none.

Bounded: caps in bytes per tenant and in all; the least recently used block goes first, with the
blocks below it (unreachable without it). A lookup refreshes a chain leaf first, so a chain's
head is always at least as recent as its tail and eviction trims chains from their ends.
Thread-safe: the step loop matches and inserts, `/health` and `/metrics` read the stats.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

GLOBAL = "*"  # the cross-tenant trie's name (opt-in)


@dataclass
class PrefixCacheConfig:
    enabled: bool = True
    block_tokens: int = 32
    max_mb: float = 1024  # all tenants (SmolLM2 fp32: 46 KB of K/V + 7 KB of features per token)
    max_mb_per_tenant: float | None = None  # None: half of max_mb
    cross_tenant: bool = False  # opt-in: one trie over every tenant's prompts (see module doc)


@dataclass
class Block:
    scope: str
    parent: int  # block id, -1 at the root
    tokens: tuple[int, ...]
    k: torch.Tensor  # [layers, kv_heads, block_tokens, head_dim]
    v: torch.Tensor
    features: torch.Tensor | None = None  # [block_tokens, n * hidden] of `layers`, if captured
    layers: tuple[int, ...] = ()
    children: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        f = self.features.nbytes if self.features is not None else 0
        return self.k.nbytes + self.v.nbytes + f


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig | None = None) -> None:
        self.config = config or PrefixCacheConfig()
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._blocks: dict[int, Block] = {}
        self._ids: dict[tuple[str, int, tuple[int, ...]], int] = {}  # (scope, parent, tokens) -> id
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._next = 0
        self.hits = self.lookups = self.reused_tokens = self.evicted = 0

    def scope(self, tenant: str) -> str:
        return GLOBAL if self.config.cross_tenant else tenant

    # --- the step loop's calls ------------------------------------------------------------------

    def match(self, tenant: str, prompt: list[int], layers: tuple[int, ...] | None) -> list[Block]:
        """The longest chain of cached blocks that `prompt` starts with, leaving at least its last
        token to prefill (its logits give the first output token). `layers`: the request's
        drafter context needs features of these layers, so the chain stops at a block without them."""
        if not self.config.enabled:
            return []
        b, scope = self.config.block_tokens, self.scope(tenant)
        chain: list[Block] = []
        ids: list[int] = []
        with self._lock:
            self.lookups += 1
            parent = -1
            for a in range(0, len(prompt) - 1 - b + 1, b):
                bid = self._ids.get((scope, parent, tuple(prompt[a : a + b])))
                if bid is None:
                    break
                blk = self._blocks[bid]
                if layers is not None and (blk.features is None or blk.layers != layers):
                    break
                chain.append(blk)
                ids.append(bid)
                parent = bid
            self._touch(ids)
            if chain:
                self.hits += 1
                self.reused_tokens += b * len(chain)
        return chain

    def insert(self, tenant: str, prompt: list[int], k: torch.Tensor, v: torch.Tensor,
               features: torch.Tensor | None, layers: tuple[int, ...], start: int) -> None:  # fmt: skip
        """Add the full blocks of `prompt` after a prefill that computed positions `start`.. into a
        slot whose K/V are `k`, `v` ([layers, kv_heads, capacity, D]); `features` are that
        prefill's captured rows (positions start..), or None. Blocks already cached are refreshed
        (and given features if they had none)."""
        if not self.config.enabled:
            return
        b, scope = self.config.block_tokens, self.scope(tenant)
        with self._lock:
            parent, chain = -1, []
            for a in range(0, len(prompt) - b + 1, b):
                key = (scope, parent, tuple(prompt[a : a + b]))
                rows = features[a - start : a - start + b] if features is not None and a >= start else None
                bid = self._ids.get(key)
                if bid is None:
                    if a < start:  # its head was evicted meanwhile: nothing to chain to
                        break
                    bid = self._add(key, k[:, :, a : a + b].clone(), v[:, :, a : a + b].clone())
                blk = self._blocks[bid]
                if rows is not None and (blk.features is None or blk.layers != layers):
                    self._bytes[scope] -= blk.nbytes
                    blk.features, blk.layers = rows.clone(), layers
                    self._bytes[scope] += blk.nbytes
                chain.append(bid)
                parent = bid
            self._touch(chain)
            self._evict(scope)

    def _add(self, key: tuple[str, int, tuple[int, ...]], k: torch.Tensor, v: torch.Tensor) -> int:
        scope, parent, tokens = key
        bid, self._next = self._next, self._next + 1
        self._blocks[bid] = blk = Block(scope, parent, tokens, k, v)
        self._ids[key] = bid
        if parent >= 0:
            self._blocks[parent].children.add(bid)
        self._bytes[scope] = self._bytes.get(scope, 0) + blk.nbytes
        return bid

    def _touch(self, chain: list[int]) -> None:
        for bid in reversed(chain):  # the head most recent: eviction trims chains from the end
            self._lru[bid] = None
            self._lru.move_to_end(bid)

    def _evict(self, scope: str) -> None:
        mb = 2**20
        cap = self.config.max_mb * mb
        tenant_cap = cap / 2 if self.config.max_mb_per_tenant is None else self.config.max_mb_per_tenant * mb
        while self._bytes.get(scope, 0) > tenant_cap:
            self._drop(next(bid for bid in self._lru if self._blocks[bid].scope == scope))
        while sum(self._bytes.values()) > cap:
            self._drop(next(iter(self._lru)))

    def _drop(self, bid: int) -> None:
        blk = self._blocks.pop(bid)
        for child in list(blk.children):
            self._drop(child)
        del self._ids[(blk.scope, blk.parent, blk.tokens)]
        del self._lru[bid]
        self._bytes[blk.scope] -= blk.nbytes
        if self._bytes[blk.scope] <= 0:  # its last block: a tenant id that never comes back is not kept
            del self._bytes[blk.scope]
        if blk.parent in self._blocks:
            self._blocks[blk.parent].children.discard(bid)
        self.evicted += 1

    # --- what operators and the bench see --------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": self.config.enabled,
                "blocks": len(self._blocks),
                "tokens": len(self._blocks) * self.config.block_tokens,
                "bytes": sum(self._bytes.values()),
                "tenants": sum(1 for n in self._bytes.values() if n > 0),
                "lookups": self.lookups,
                "hits": self.hits,
                "reused_tokens": self.reused_tokens,
                "evicted": self.evicted,
            }

    def snapshot(self) -> dict:
        """The cache's contents, for `restore` (the bench times every run from the same state)."""
        with self._lock:
            return {
                "blocks": _copy_blocks(self._blocks),
                "ids": dict(self._ids),
                "lru": OrderedDict(self._lru),
                "bytes": dict(self._bytes),
                "next": self._next,
            }

    def restore(self, snap: dict) -> None:
        with self._lock:
            self._blocks = _copy_blocks(snap["blocks"])
            self._ids, self._lru = dict(snap["ids"]), OrderedDict(snap["lru"])
            self._bytes, self._next = dict(snap["bytes"]), snap["next"]

    def clear(self) -> None:
        with self._lock:
            self._reset()


def _copy_blocks(blocks: dict[int, Block]) -> dict[int, Block]:
    """Blocks whose trie links can change without touching `blocks` (the tensors are shared:
    nothing writes into a cached block)."""
    out = {bid: copy.copy(blk) for bid, blk in blocks.items()}
    for blk in out.values():
        blk.children = set(blk.children)
    return out
