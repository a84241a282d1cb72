"""The frozen target: a gpt-fast style Llama/Qwen3 forward over HF weights with a preallocated,
per-request KV cache.

One call runs a padded batch `tokens[B, T]`; request b's tokens sit at positions
`cache.lengths[b] + t`. The forward writes their K/V into the cache but does not advance
`lengths`: the caller commits how many of them were accepted (`KVCache.commit`). Entries past a
request's committed length are stale and are never attended to, because attention is causal on
absolute positions — rejecting drafted tokens is therefore free (no copy, no reallocation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models.layers import Block, RMSNorm, apply_rope, attention_dtype, rope_tables
from adaflash.models.packed import fused_linear


@dataclass(frozen=True)
class TargetConfig:
    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class KVCache:
    """Preallocated K/V for a batch of requests: [layers, B, kv_heads, capacity, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor  # [B] committed tokens per request

    @classmethod
    def allocate(
        cls,
        config: TargetConfig,
        batch: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def commit(self, counts: torch.Tensor) -> None:
        self.lengths += counts.to(self.lengths.dtype)


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, H] after the final norm (feed to `TargetModel.logits`)
    features: torch.Tensor | None  # [B, T, len(capture) * H] raw outputs of the captured layers


class Attention(nn.Module):
    def __init__(self, c: TargetConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, heads, T, D], with the qk-norm and RoPE applied (shared with the
        packed serving runner, which then attends against its slot cache)."""
        B, T, _ = x.shape
        c = self.c
        q, k, v = fused_linear(self, "qkv", x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Queries and keys rotated as one tensor: one RoPE per layer instead of two (the same
        # element-wise products; a decode step is mostly small ops like these).
        qk = apply_rope(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        return q, k, v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        write_index: torch.Tensor,
        mask: torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        q, k, v = (t.to(cache_k.dtype) for t in self.project(x, cos, sin))
        idx = write_index[:, None, :, None].expand(B, c.num_kv_heads, T, c.head_dim)
        cache_k.scatter_(2, idx, k)
        cache_v.scatter_(2, idx, v)
        out = F.scaled_dot_product_attention(
            q, cache_k[:, :, :span], cache_v[:, :, :span], attn_mask=mask, enable_gqa=True
        )
        return self.output(out.transpose(1, 2).reshape(B, T, -1).to(x.dtype))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear(self, "o", x, self.o_proj)[0]


class TargetModel(nn.Module):
    """Frozen Llama/Qwen3 decoder. Parameter names match HF's (without the `model.` prefix)."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        c = config
        self.layers = nn.ModuleList(
            Block(Attention(c), c.hidden_size, c.intermediate_size, c.rms_norm_eps)
            for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        device = self.embed_tokens.weight.device
        return KVCache.allocate(self.config, batch, capacity, attention_dtype(self.dtype), device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits; without autograd through the prepacked head (`models.packed`). It is
        the widest matmul of a small model and verification reads k rows of it every round
        (measured, SmolLM2's 49k×576 fp32 head, 2 threads: 1 row 6.8 → 5.6 ms, 8 rows 13.9 → 6.0,
        32 rows 24.0 → 12.1 against the best plain layout for each size)."""
        if torch.is_grad_enabled() and hidden.requires_grad:
            return self.lm_head(hidden)
        with torch.no_grad():
            return fused_linear(self, "lm_head", hidden, self.lm_head)[0]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run `tokens[B, T]` at positions `cache.lengths[b] + t`; write their K/V; do not commit.

        `capture_layers` are 0-based layer ids whose outputs (HF `hidden_states[l + 1]`) are
        concatenated into `features` — the drafter's context features.
        """
        B, T = tokens.shape
        positions = cache.lengths[:, None] + torch.arange(T, device=tokens.device)[None, :]
        span = int(positions.max()) + 1
        if span > cache.capacity:
            raise ValueError(f"KV cache capacity {cache.capacity} exceeded (need {span})")
        c = self.config
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, self.dtype)
        # Causal on absolute positions: hides stale (rejected) entries and other requests' padding.
        mask = (torch.arange(span, device=tokens.device)[None, None, :] <= positions[:, :, None])[:, None]
        x = self.embed_tokens(tokens)
        captured: list[torch.Tensor] = []
        wanted = set(capture_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], positions, mask, span)
            if i in wanted:
                captured.append(x)
        features = None
        if capture_layers:
            by_id = dict(zip(sorted(wanted), captured, strict=True))
            features = torch.cat([by_id[i] for i in capture_layers], dim=-1)
        return ForwardOutput(hidden=self.norm(x), features=features)
