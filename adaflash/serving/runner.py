"""Model runner for packed (ragged) batches: *how* a step runs; the scheduler decides *what*.

A step hands the runner a list of segments — one per request: a prefill (the whole prompt) or a
verify (anchor + k̂−1 drafts) — each writing into the request's own slot of a preallocated KV
cache `[layers, slots, kv_heads, capacity, head_dim]`. Every linear layer (q/k/v/o projections,
MLP, norms) runs once over the concatenation of all segments' tokens, Σ n_i rows with no padding
to k. Attention is the only per-request operation: each query sees its own slot's keys up to its
absolute position. An fp32 target on the CPU runs every layer through our C kernels
(`_forward_fused`: one attention call for all rows, whatever their segments; docs/serving.md).
Otherwise (bf16, no C compiler): short segments (decode/verify) share an SDPA call over a gathered
`[R, kv_heads, span, D]` view of their slots with a block-causal mask, bucketed by context length
so that padding to the group's longest span stays bounded; long ones (prefills) get their own
call so one 300-token prompt does not pad thirty 4-token verifies to 300 rows.
Rejected drafts need no cleanup: their K/V sit past the request's committed length and are
overwritten by the next step (attention is causal on absolute positions).

`DrafterSlots` is the drafter's per-request context cache in the same slot layout: each
committed token's target features are projected by `fc` and every layer's k/v projections once,
when the token is committed, never again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaflash.models import row_ops, slot_attention
from adaflash.models.drafter import Drafter
from adaflash.models.layers import RMSNorm, attention_dtype, rope_tables
from adaflash.models.packed import frozen_linear
from adaflash.models.transformer import KVCache, TargetModel

# Segments longer than this get their own attention call (see module docstring).
LONG_SEGMENT = 32
# Bytes of queued committed-row features past which the drafter context drops or projects them,
# drafting or not (64 MB: ~5.8k rows of the shipped drafter's 5 x 576 fp32 features, a C = 32 wave of
# ~180-token prompts).
FLUSH_BYTES = 64 * 2**20


@dataclass
class Segment:
    slot: int
    start: int  # absolute position of tokens[0] (= the request's committed KV length)
    tokens: list[int]


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] absolute positions
    slot_rows: torch.Tensor  # [N] slot of each row
    cu: torch.Tensor  # [R+1] segment boundaries in the packed rows
    slots: torch.Tensor  # [R]
    starts: torch.Tensor  # [R]
    lengths: torch.Tensor  # [R]

    @classmethod
    def build(cls, segments: list[Segment]) -> PackedBatch:
        lengths = torch.tensor([len(s.tokens) for s in segments], dtype=torch.long)
        starts = torch.tensor([s.start for s in segments], dtype=torch.long)
        slots = torch.tensor([s.slot for s in segments], dtype=torch.long)
        cu = torch.zeros(len(segments) + 1, dtype=torch.long)
        cu[1:] = lengths.cumsum(0)
        seg_of_row = torch.repeat_interleave(torch.arange(len(segments)), lengths)
        within = torch.arange(int(cu[-1])) - cu[:-1][seg_of_row]
        tokens = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.long)
        return cls(tokens, starts[seg_of_row] + within, slots[seg_of_row], cu, slots, starts, lengths)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel())


@dataclass
class _AttnGroup:
    """Segments attended together: padded queries [R, heads, W, D] over their gathered slots."""

    rows: torch.Tensor  # packed row indices of the group's tokens, in order
    seg: torch.Tensor  # [n_rows] index within the group of each row's segment
    within: torch.Tensor  # [n_rows] index of each row inside its segment
    slots: torch.Tensor  # [R]
    width: int
    span: int
    mask: torch.Tensor | None  # [R, 1, W, span]
    # Slots first..first+R-1 in order: their keys are a view of the cache, no gather copy.
    first_slot: int | None
    # Every segment is `width` long and the rows are the packed rows in order (the common decode
    # step: all k̂ equal): queries are a view of the packed rows, no scatter or gather.
    dense: bool


def _span_buckets(ends: list[tuple[int, int]]) -> list[list[int]]:
    """Split (end position, segment) pairs into groups whose spans are within ~1.5x of each other.

    A group's gathered keys are padded to its longest span: one 1,800-token request in a batch of
    100-token ones would otherwise make every request attend over (and copy) 1,800 positions.
    """
    buckets: list[list[int]] = []
    first_end = 0
    for end, i in sorted(ends):
        if not buckets or end > 1.5 * first_end + 64:
            buckets.append([])
            first_end = end
        buckets[-1].append(i)
    return buckets


def _attention_groups(batch: PackedBatch) -> list[_AttnGroup]:
    ends = (batch.starts + batch.lengths).tolist()
    lens = batch.lengths.tolist()
    short = [(ends[i], i) for i in range(len(lens)) if lens[i] <= LONG_SEGMENT]
    long = [[i] for i in range(len(lens)) if lens[i] > LONG_SEGMENT]
    groups = []
    slot_of = batch.slots.tolist()
    for members in _span_buckets(short) + long:
        members = sorted(members, key=slot_of.__getitem__)
        idx = torch.tensor(members, dtype=torch.long)
        lens, starts = batch.lengths[idx], batch.starts[idx]
        width = int(lens.max())
        span = int((starts + lens).max())
        seg = torch.repeat_interleave(torch.arange(len(members)), lens)
        within = torch.cat([torch.arange(int(n)) for n in lens])
        rows = batch.cu[:-1][idx][seg] + within
        # Query w of segment r sits at starts[r] + w; it sees keys at positions <= its own. Padded
        # query rows (w >= len) still see position 0..start, so no row is all -inf (no NaNs).
        qpos = starts[:, None] + torch.arange(width)[None, :]
        mask = (torch.arange(span)[None, None, :] <= qpos[:, :, None])[:, None]
        if len(members) == 1 and width == 1:
            mask = None  # a lone decode token sees its whole slot: let SDPA take its unmasked path
        slots = [slot_of[i] for i in members]
        first = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None
        dense = bool((lens == width).all()) and torch.equal(rows, torch.arange(batch.num_rows))
        groups.append(_AttnGroup(rows, seg, within, batch.slots[idx], width, span, mask, first, dense))
    return groups


def _norm(norm: RMSNorm) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.eps


class PackedRunner:
    """Runs the frozen target over packed segments against a preallocated slot KV cache."""

    def __init__(self, model: TargetModel, slots: int, capacity: int) -> None:
        self.model = model
        self.config = model.config
        self.cache = KVCache.allocate(model.config, slots, capacity, attention_dtype(model.dtype))
        self.last_num_rows = 0  # rows the last forward ran through the linear layers (tests, metrics)
        c = model.config
        # Our C kernels (`_forward_fused`) where they apply: an fp32 model on the CPU with a C
        # compiler; else the PyTorch layers and SDPA. `ADAFLASH_FUSED_RUNNER=0` forces the latter.
        self.fused = (
            os.environ.get("ADAFLASH_FUSED_RUNNER", "1") != "0"
            and model.dtype == torch.float32
            and self.cache.k.device.type == "cpu"
            and c.head_dim % 16 == 0
            and c.hidden_size % 8 == 0
            and c.intermediate_size % 8 == 0
            and row_ops.available()
        )

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @torch.no_grad()
    def forward(
        self, batch: PackedBatch, capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden [N, H], captured features [N, len(capture) * H] or None).

        Callers take logits only at the rows they need (`model.logits(hidden[rows])`): the LM
        head is the widest matmul of a small model.
        """
        if int((batch.starts + batch.lengths).max()) > self.capacity:
            raise ValueError(f"KV slot capacity {self.capacity} exceeded")
        self.last_num_rows = batch.num_rows
        c, m = self.config, self.model
        cos, sin = rope_tables(batch.positions[None], c.head_dim, c.rope_theta, m.dtype)
        if self.fused:
            return self._forward_fused(batch, cos[0], sin[0], capture_layers)
        groups = _attention_groups(batch)
        wanted = {layer: None for layer in capture_layers}
        x = m.embed_tokens(batch.tokens)
        for i, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, cos, sin, i, batch, groups)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in wanted:
                wanted[i] = x
        features = torch.cat([wanted[i] for i in capture_layers], dim=-1) if capture_layers else None
        return m.norm(x), features

    def _forward_fused(
        self, batch: PackedBatch, cos: torch.Tensor, sin: torch.Tensor, capture_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` through our C kernels: per layer, five calls (q/k/v matmul, attention with
        RoPE and the KV write, o matmul + residual + norm, gate/up matmul + SiLU·up, down matmul
        + residual + the next norm) instead of ~35 PyTorch ops; every one computes each row alone."""
        c, m = self.config, self.model
        layers = m.layers
        wanted = {layer: None for layer in capture_layers}
        x, h = row_ops.add_rms_norm(m.embed_tokens(batch.tokens), None, *_norm(layers[0].input_layernorm))
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = frozen_linear(attn, "qkv", attn.q_proj, attn.k_proj, attn.v_proj)(h)
            qk_norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if c.qk_norm else ()
            ck, cv = self.cache.k[i], self.cache.v[i]
            rows = (batch.slot_rows, batch.positions)
            out = slot_attention.attend(qkv, cos, sin, ck, cv, *rows, c.num_heads, *qk_norms)
            o = frozen_linear(attn, "o", attn.o_proj)(out.view(out.shape[0], -1))
            x, h = row_ops.add_rms_norm(x, o, *_norm(layer.post_attention_layernorm))
            up = row_ops.silu_mul(frozen_linear(mlp, "gate_up", mlp.gate_proj, mlp.up_proj)(h))
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else m.norm
            x, h = row_ops.add_rms_norm(x, frozen_linear(mlp, "down", mlp.down_proj)(up), *_norm(after))
            if i in wanted:
                wanted[i] = x
        features = torch.cat([wanted[i] for i in capture_layers], dim=-1) if capture_layers else None
        return h, features

    def _attention(self, attn, h, cos, sin, layer: int, batch: PackedBatch, groups: list[_AttnGroup]):
        c = self.config
        N = h.shape[0]
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # [slots, kvh, cap, D]
        # The model's own projection + RoPE, the packed rows read as one sequence of N tokens;
        # attention in the cache's dtype (`attention_dtype`).
        q, k, v = (t[0].transpose(0, 1).to(ck.dtype) for t in attn.project(h[None], cos, sin))  # [N, h, D]
        ck[batch.slot_rows, :, batch.positions] = k
        cv[batch.slot_rows, :, batch.positions] = v
        # One dense group (a uniform decode step): its output is already in packed row order.
        whole = len(groups) == 1 and groups[0].dense
        out = None if whole else torch.empty_like(q)
        for g in groups:
            R = g.slots.numel()
            if g.dense:
                qp = q.view(R, g.width, c.num_heads, c.head_dim)
            else:
                qp = q.new_zeros(R, g.width, c.num_heads, c.head_dim)
                qp[g.seg, g.within] = q[g.rows]
            if g.first_slot is not None:  # consecutive slots: a view, no gather copy
                kp = ck[g.first_slot : g.first_slot + R, :, : g.span]
                vp = cv[g.first_slot : g.first_slot + R, :, : g.span]
            else:
                kp = ck[:, :, : g.span].index_select(0, g.slots)
                vp = cv[:, :, : g.span].index_select(0, g.slots)
            o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp, vp, attn_mask=g.mask, enable_gqa=True)
            if whole:
                out = o.transpose(1, 2).reshape(N, c.num_heads, c.head_dim)
            else:
                out[g.rows] = o.transpose(1, 2)[g.seg, g.within]
        return attn.output(out.reshape(N, -1).to(h.dtype))


class DrafterSlots:
    """Per-request drafter context K/V, slot layout `[slots, kv_heads, capacity, D]` per layer.

    A slot's context length always equals the request's committed target length: both grow by
    the anchor plus the accepted drafts of each round. Committed rows' features are projected
    lazily and per slot: `extend` queues them under their slot, and a slot's queue is projected
    (batched with the others drafted in the same step) only when that slot drafts a block. A
    request that never drafts (an AR round of the cost policy, every round at high load) never
    pays a drafter op; the projection is row-wise, so batching or delaying it changes no value.
    The queue is bounded (`flush_bytes`). Past it, the longest queues of `droppable` slots (the
    cost policy's requests, which may decode without the drafter) are dropped, not projected, and
    those slots are `lost` until their next occupant: projecting a C = 32 prefill wave that
    never drafts cost 1.4 s of a 51 s edit cell. What is still past it then (slots whose
    method drafts every round) is projected at once.
    """

    def __init__(self, drafter: Drafter, slots: int, capacity: int, flush_bytes: int = FLUSH_BYTES) -> None:
        c = drafter.config
        self.drafter = drafter
        self.capacity, self.flush_bytes = capacity, flush_bytes
        dtype = drafter.fc.weight.dtype
        shape = (slots, c.num_kv_heads, capacity, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(c.num_layers)]
        # slot -> its committed rows not yet projected, oldest first: (features [m, n*H], positions
        # [m], the bytes they count against `flush_bytes`)
        self._queued: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self._queued_bytes = 0
        self.droppable: set[int] = set()  # slots whose queue the bound may drop (`set_droppable`)
        self.lost: set[int] = set()  # slots whose context was dropped: they cannot draft
        self.dropped_rows = 0  # committed rows dropped past the bound, since start

    @property
    def queued_bytes(self) -> int:
        """What the queue counts against `flush_bytes` (an int: safe to read from another thread)."""
        return self._queued_bytes

    @property
    def queued_rows(self) -> int:
        return sum(self.pending(slot) for slot in self._queued)

    def pending(self, slot: int) -> int:
        """Rows the slot's next draft projects first (its queue)."""
        return sum(p.numel() for _, p, _ in self._queued.get(slot, ()))

    def extend(self, features: torch.Tensor, slot_rows: torch.Tensor, positions: torch.Tensor,
               shared: bool = False) -> None:  # fmt: skip
        """Queue committed rows' target features [M, n*H] under their slots (rows of one slot are
        contiguous: the engine commits them request by request). `shared`: the tensor is held
        elsewhere anyway (a prefix-cache block), so it does not count toward `flush_bytes`: a
        request that reuses a long head and never drafts never pays for projecting it."""
        n = features.shape[0]
        if n == 0:
            return
        cuts = (torch.nonzero(slot_rows[1:] != slot_rows[:-1]).flatten() + 1).tolist()
        bounds = [0, *cuts, n]
        for a, b in zip(bounds, bounds[1:], strict=False):
            slot = int(slot_rows[a])
            if int(positions[a]) == 0:  # a new occupant's prefill: the slot's old queue is stale
                self._drop(slot)
                self.lost.discard(slot)
            elif slot in self.lost:  # a context with a hole is never completed
                continue
            nbytes = 0 if shared else (b - a) * features.shape[1] * features.element_size()
            self._queued.setdefault(slot, []).append((features[a:b], positions[a:b], nbytes))
            self._queued_bytes += nbytes
        if self._queued_bytes >= self.flush_bytes:
            self._evict()
        if self._queued_bytes >= self.flush_bytes:
            self.flush()

    def set_droppable(self, slot: int, droppable: bool) -> None:
        """Whether the slot's occupant may lose its drafter context past the bound (set at
        admission: a method that drafts every round may not)."""
        if droppable:
            self.droppable.add(slot)
        else:
            self.droppable.discard(slot)

    def _evict(self) -> None:
        """Drop the longest droppable queues until half the bound is free."""
        sizes = {s: sum(n for _, _, n in self._queued[s]) for s in self._queued if s in self.droppable}
        for slot in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if self._queued_bytes < self.flush_bytes // 2 or not sizes[slot]:
                break
            self.dropped_rows += sum(p.numel() for _, p, _ in self._queued[slot])
            self._drop(slot)
            self.lost.add(slot)

    def _drop(self, slot: int) -> None:
        for _, _, nbytes in self._queued.pop(slot, []):
            self._queued_bytes -= nbytes

    @torch.no_grad()
    def flush(self, slots: list[int] | None = None) -> None:
        """Project the queued rows of `slots` (default: every slot) into the context cache, in one
        batched call. Within a slot the newest write of a position wins, as it would have step by
        step (a rejected-then-recommitted position, a reused slot)."""
        keys = list(self._queued) if slots is None else [s for s in dict.fromkeys(slots) if s in self._queued]
        if not keys:
            return
        parts = [(f, p, s) for s in keys for f, p, _ in self._queued[s]]
        for s in keys:
            self._drop(s)
        features = torch.cat([f for f, _, _ in parts])
        positions = torch.cat([p for _, p, _ in parts])
        slot_rows = torch.cat([torch.full((p.numel(),), s, dtype=torch.long) for _, p, s in parts])
        key = slot_rows * self.capacity + positions
        if torch.unique(key).numel() != key.numel():
            order = torch.arange(key.numel())
            newest = torch.full((int(key.max()) + 1,), -1, dtype=torch.long).scatter_reduce(
                0, key, order, "amax"
            )
            keep = newest[key] == order
            features, slot_rows, positions = features[keep], slot_rows[keep], positions[keep]
        kv = self.drafter.context_kv(features[None], positions[None])
        for (k, v), ck, cv in zip(kv, self.k, self.v, strict=True):
            ck[slot_rows, :, positions] = k[0].transpose(0, 1)
            cv[slot_rows, :, positions] = v[0].transpose(0, 1)

    @torch.no_grad()
    def draft_hidden(
        self, slots: torch.Tensor, lengths: torch.Tensor, block_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Final drafter hidden states [R, k, H] of one block per request (block at lengths[r]).

        Requests are bucketed by context length like the target's attention, so one long
        conversation does not pad every other request's context to its length.
        """
        if lost := self.lost.intersection(slots.tolist()):
            raise RuntimeError(f"drafter context of slots {sorted(lost)} was dropped: they cannot draft")
        self.flush(slots.tolist())
        buckets = _span_buckets(list(zip(lengths.tolist(), range(len(lengths)), strict=True)))
        if len(buckets) == 1:
            return self._draft(slots, lengths, block_embeds)
        out = torch.empty_like(block_embeds)
        for members in buckets:
            idx = torch.tensor(members)
            out[idx] = self._draft(slots[idx], lengths[idx], block_embeds[idx])
        return out

    def _draft(self, slots: torch.Tensor, lengths: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        R, T, _ = block_embeds.shape
        span = int(lengths.max())
        positions = lengths[:, None] + torch.arange(T)[None, :]
        visible = (torch.arange(span)[None, :] < lengths[:, None])[:, None, :].expand(R, T, span)
        kv = [
            (k[:, :, :span].index_select(0, slots), v[:, :, :span].index_select(0, slots))
            for k, v in zip(self.k, self.v, strict=True)
        ]
        return self.drafter.forward(block_embeds, positions, kv, visible)
