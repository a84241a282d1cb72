"""Building blocks shared by the target runner and the drafter (Llama/Qwen3 family).

Module and parameter names follow Hugging Face's Llama/Qwen3 so weights load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models.packed import fused_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least fp32: deep SmolLM2 activations reach ~2.5e4 (DESIGN §4).
        dtype = x.dtype
        if dtype in (torch.float32, torch.float64) and self.weight.dtype == dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_linear(self, "gate_up", x, self.gate_proj, self.up_proj)
        return fused_linear(self, "down", F.silu(gate) * up, self.down_proj)[0]


class Block(nn.Module):
    """One pre-norm decoder layer: x + attention(norm(x)), then x + MLP(norm(x)). The target's
    layers and the drafter's differ only in their attention module (causal over a KV cache, or
    non-causal over context ‖ block), which is passed in and receives `attn_args` as they come."""

    def __init__(self, attention: nn.Module, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = GatedMLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """Keys, values and the attention itself run in at least fp32. Why: PyTorch's CPU SDPA is
    slow in bf16 for a few query rows (measured, 32 requests x 1 query, 200 keys: 4.6 ms in bf16,
    0.56 ms in fp32), and fp32 scores are what the bf16 target's own reference uses too. The
    cache costs twice the bytes of a bf16 one."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) for integer `positions` (any shape) -> shape positions.shape + (head_dim,).

    The sin table carries rotate-half's sign (its first half negated), so `apply_rope` rotates
    with one `roll` instead of slicing, negating and concatenating every call: the same products
    bit for bit ((-x)·s = x·(-s) exactly), in 4 ops instead of 9 (a decode step runs 30 layers).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    )
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    sign = torch.ones(head_dim, dtype=torch.float64, device=positions.device)
    sign[: head_dim // 2] = -1
    return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D] from `rope_tables` (rotate-half convention of HF
    Llama: x·cos + [-x₂, x₁]·sin, with the sign already in `sin`)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * sin[:, None]
