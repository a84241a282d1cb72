"""Causal attention of packed rows against a slot KV cache, one C call per layer.

Why: a serving step mixes prefills, k̂-token verifies and 1-token decodes of many requests. With
PyTorch's SDPA that means padding each group of requests to a common width and span under a mask,
gathering their slots and calling SDPA per group; at one query row per request its CPU flash
kernel is slow (SmolLM2 at C = 32: 81 ms of a 239 ms step). `csrc/slot_attention.c` instead runs
each (row, kv head) as one task over exactly its request's keys 0..position, in a fixed order:
no mask, no padding, no gather, and a row's bits do not depend on the rows beside it, so a token
verified among k̂ drafts gets the bits it gets decoded alone.

It also applies RoPE (and Qwen3's q/k norms) and writes the rows' K/V into the cache: a layer's
attention is one call from its fused q/k/v projection. Built with the row-wise matmul
(`kernels.py`); without a C compiler the runner attends with SDPA.
"""

from __future__ import annotations

import math

import torch

from adaflash.models.kernels import library


def attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slot_rows: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """A layer's attention from its fused projection, in one call.

    qkv [N, (H + 2 KVH) D] fp32 (q heads, then k, then v); cos / sin [N, D] from `rope_tables`;
    cache_k / cache_v [slots, KVH, cap, D] fp32, contiguous. Row n's k and v (RoPE on k, and
    Qwen3's per-head `q_norm` / `k_norm` where given) are written into cache[slot_rows[n]] at
    positions[n]; then row n attends to that slot's positions 0..positions[n]. Returns [N, H, D].
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the slot attention kernel is not available on this machine")
    slots, kv_heads, cap, D = cache_k.shape
    N = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * kv_heads) * D or num_heads % kv_heads or D % 16:
        fit = f"{num_heads} heads over cache {tuple(cache_k.shape)}"
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {fit}")
    if cos.shape != (N, D) or sin.shape != (N, D) or cache_v.shape != cache_k.shape:
        raise ValueError("cos/sin must be [N, D] and the K and V caches alike")
    tensors = [qkv, cos, sin, cache_k, cache_v] + [t for t in (q_norm, k_norm) if t is not None]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the slot attention kernel runs fp32 on the CPU")
    if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        raise ValueError("the KV cache must be contiguous (it is written in place)")
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slot_rows, positions = slot_rows.to(torch.long).contiguous(), positions.to(torch.long).contiguous()
    q_norm = q_norm.contiguous() if q_norm is not None else None
    k_norm = k_norm.contiguous() if k_norm is not None else None
    out = torch.empty(N, num_heads, D, dtype=torch.float32, device=qkv.device)
    if N and lib.slot_attention(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(),
        eps,
        slot_rows.data_ptr(),
        positions.data_ptr(),
        cache_k.data_ptr(),
        cache_v.data_ptr(),
        out.data_ptr(),
        N,
        num_heads,
        kv_heads,
        slots,
        cap,
        D,
        1.0 / math.sqrt(D),
        torch.get_num_threads(),
    ):
        raise ValueError(f"a row's slot or position is outside the cache ({slots} slots x {cap})")
    return out
