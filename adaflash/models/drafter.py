"""The DFlash-style block-diffusion drafter (DESIGN §1).

One non-causal forward fills a block of k positions: block = [anchor, MASK x (k-1)], where the
anchor is the newest committed token. Queries come from the block's token embeddings (the
target's own `embed_tokens`); keys/values are [context ‖ block], where the context is the
concatenation of target hidden states from `target_layer_ids`, projected by `fc` and normalised
by `hidden_norm`. The context does not flow through the drafter's layers: each layer projects the
same normalised context with its own k/v projections, so a request's context K/V can be computed
once per token and cached (`DrafterContext`). Layers are Qwen3 decoder layers (q/k RMSNorm,
RoPE) with non-causal attention. Logits come from the target's shared, frozen `lm_head`.

Parameter names and `config.json` follow the public DFlash format, so a saved directory loads in
`dflash.model.DFlashDraftModel` and in SGLang's DFLASH worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models import hf_config
from adaflash.models.layers import Block, RMSNorm, apply_rope, rope_tables
from adaflash.models.packed import fused_linear


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread from layer 1 to layer L-3 (DFlash's choice of feature layers)."""
    if count == 1:
        return (num_target_layers // 2,)
    start = 1
    # Shallow targets (tests) cannot spare the top 3 layers and still give distinct ids.
    end = max(num_target_layers - 3, min(num_target_layers - 1, start + count - 1))
    ids = (round(start + i * (end - start) / (count - 1)) for i in range(count))
    return tuple(sorted(set(ids)))


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def to_hf(self) -> dict:
        """`config.json` in the DFlash format (a Qwen3 config plus the DFlash fields)."""
        from transformers import Qwen3Config

        base = Qwen3Config(**hf_config.to_hf(self), tie_word_embeddings=False).to_dict()
        base.update(
            architectures=["DFlashDraftModel"],
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            dtype="float32",
        )
        return base

    @classmethod
    def from_hf(cls, hf: dict) -> DrafterConfig:
        dcfg = hf.get("dflash_config", {})
        return cls(
            **hf_config.from_hf(hf, rms_norm_eps=1e-6, max_position_embeddings=8192),
            num_target_layers=hf["num_target_layers"],
            target_layer_ids=tuple(dcfg.get("target_layer_ids", hf.get("target_layer_ids", ()))),
            mask_token_id=int(dcfg.get("mask_token_id", hf.get("mask_token_id"))),
            block_size=int(dcfg.get("block_size", hf.get("block_size", 16))),
        )


class DrafterAttention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values [B, kv_heads, T, D] for inputs x [B, T, H]."""
        B, T, _ = x.shape
        k, v = fused_linear(self, "kv", x, self.k_proj, self.v_proj)
        k = self.k_norm(k.view(B, T, self.c.num_kv_heads, self.c.head_dim))
        v = v.view(B, T, self.c.num_kv_heads, self.c.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(
            fused_linear(self, "q", x, self.q_proj)[0].view(B, T, self.c.num_heads, self.c.head_dim)
        )
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Training under CPU bf16 autocast keeps attention in fp32: CPU SDPA's bf16 backward
            # is slower than its fp32 one (measured, SmolLM2 bootstrap step: 985 -> 839 ms).
            with torch.autocast("cpu", enabled=False):
                q, k, v = q.float(), k.float(), v.float()
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return fused_linear(self, "o", out.transpose(1, 2).reshape(B, T, -1), self.o_proj)[0]


@dataclass
class DrafterContext:
    """Per-request cached context K/V of every drafter layer: [B, kv_heads, capacity, D] each.

    `lengths[b]` counts the context positions of request b (its committed tokens whose target
    features exist); entries past it are stale and masked out.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(
            Block(DrafterAttention(c), c.hidden_size, c.intermediate_size, c.rms_norm_eps)
            for _ in range(c.num_layers)
        )
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V for target features [B, S, n*H] at absolute positions [B, S]."""
        ctx = self.hidden_norm(fused_linear(self, "fc", features.to(self.fc.weight.dtype), self.fc)[0])
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_visible: torch.Tensor,
        block_visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, H] of a block.

        block_embeds [B, T, H]: target embeddings of [anchor, MASK, ...]; block_positions [B, T];
        ctx_kv: per-layer (k, v) [B, kv_heads, S, D]; ctx_visible [B, T, S]: which context
        positions each block query may see. The block itself is fully visible, unless
        `block_visible` [B, T, T] says otherwise (training packs several blocks in one row).
        """
        B, T, _ = block_embeds.shape
        cos, sin = self._rope(block_positions, block_embeds.dtype)
        own = block_visible
        if own is None:
            own = torch.ones(B, T, T, dtype=torch.bool, device=ctx_visible.device)
        mask = torch.cat([ctx_visible, own], dim=-1)[:, None]
        x = block_embeds
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    # --- incremental context for decoding -------------------------------------------------

    def new_context(self, batch: int, capacity: int) -> DrafterContext:
        c = self.config
        dtype = self.fc.weight.dtype
        shape = (batch, c.num_kv_heads, capacity, c.head_dim)
        return DrafterContext(
            k=[torch.zeros(shape, dtype=dtype) for _ in range(c.num_layers)],
            v=[torch.zeros(shape, dtype=dtype) for _ in range(c.num_layers)],
            lengths=torch.zeros(batch, dtype=torch.long),
        )

    @torch.no_grad()
    def extend_context(self, ctx: DrafterContext, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first counts[b] rows of features [B, T, n*H] to request b's context."""
        B, T, _ = features.shape
        positions = ctx.lengths[:, None] + torch.arange(T)[None, :]
        if int(positions.max()) >= ctx.capacity:
            raise ValueError("drafter context capacity exceeded")
        kv = self.context_kv(features, positions)
        idx = positions[:, None, :, None].expand(B, self.config.num_kv_heads, T, self.config.head_dim)
        # Rows past counts[b] land beyond the new length: stale, masked, overwritten later.
        for (k, v), ck, cv in zip(kv, ctx.k, ctx.v, strict=True):
            ck.scatter_(2, idx, k)
            cv.scatter_(2, idx, v)
        ctx.lengths += counts

    @torch.no_grad()
    def draft_hidden(self, ctx: DrafterContext, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states of one block per request; the block starts at position ctx.lengths[b]."""
        B, T, _ = block_embeds.shape
        span = int(ctx.lengths.max())
        positions = ctx.lengths[:, None] + torch.arange(T)[None, :]
        visible = (torch.arange(span)[None, :] < ctx.lengths[:, None])[:, None, :].expand(B, T, span)
        kv = [(k[:, :, :span], v[:, :, :span]) for k, v in zip(ctx.k, ctx.v, strict=True)]
        return self.forward(block_embeds, positions, kv, visible)
