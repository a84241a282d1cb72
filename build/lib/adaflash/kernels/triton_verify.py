"""Packed verification in Triton: one program per request, streaming over the vocabulary.

Same layout and results as `verify.py` (the reference): request b owns target rows
cu[b]:cu[b+1] and drafts starting at cu[b] - b. Greedy fuses the row argmax, the comparison with
the drafts and the prefix scan; sampling fuses the acceptance test, the residual
norm(max(0, p - q)) and its inverse-CDF sample, never materialising the residual.
Import this module only through the dispatcher (`adaflash.kernels`): Triton is an optional extra.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _row_argmax(row_ptr, V, BLOCK: tl.constexpr):
    best_val = -float("inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        # First index attaining the block max (torch.argmax's tie rule).
        i = tl.min(tl.where(x == m, offs, V), axis=0)
        better = m > best_val
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    return best_idx


@triton.jit
def _greedy_verify_kernel(
    drafts_ptr, logits_ptr, cu_ptr, acc_ptr, next_ptr, V, stride_row, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    row0 = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - row0
    d0 = row0 - b
    acc = 0
    done = 0
    nxt = 0
    for j in range(0, n):
        if done == 0:
            am = _row_argmax(logits_ptr + (row0 + j).to(tl.int64) * stride_row, V, BLOCK)
            is_draft = j < n - 1
            d = tl.load(drafts_ptr + d0 + j, mask=is_draft, other=-1)
            match = is_draft & (d == am)
            acc += match.to(tl.int32)
            nxt = am
            done = (~match).to(tl.int32)
    tl.store(acc_ptr + b, acc)
    tl.store(next_ptr + b, nxt)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    B = cu_seqlens.numel() - 1
    logits = target_logits.contiguous()
    acc = torch.empty(B, dtype=torch.int32, device=logits.device)
    nxt = torch.empty(B, dtype=torch.int32, device=logits.device)
    drafts = draft_tokens.contiguous() if draft_tokens.numel() else logits.new_zeros(1, dtype=torch.long)
    _greedy_verify_kernel[(B,)](
        drafts, logits, cu_seqlens.contiguous(), acc, nxt, logits.shape[1], logits.stride(0), BLOCK=BLOCK_V
    )
    return acc.long(), nxt.long()


@triton.jit
def _sampling_verify_kernel(
    drafts_ptr, q_ptr, p_ptr, cu_ptr, ua_ptr, us_ptr, acc_ptr, next_ptr,
    V, stride_q, stride_p, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row0 = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - row0
    d0 = row0 - b
    acc = 0
    done = 0
    for j in range(0, n - 1):
        if done == 0:
            x = tl.load(drafts_ptr + d0 + j)
            p_x = tl.load(p_ptr + (row0 + j).to(tl.int64) * stride_p + x)
            q_x = tl.load(q_ptr + (d0 + j).to(tl.int64) * stride_q + x)
            u = tl.load(ua_ptr + d0 + j)
            ok = u * q_x < p_x
            acc += ok.to(tl.int32)
            done = (~ok).to(tl.int32)
    rejected = acc < n - 1
    p_row = p_ptr + (row0 + acc).to(tl.int64) * stride_p
    # With every draft accepted there is no q row: point at row 0 and mask the loads off.
    q_row = q_ptr + tl.where(rejected, d0 + acc, 0).to(tl.int64) * stride_q

    # Pass 1: mass of the residual (or of p when every draft passed). q is read only when a
    # draft was rejected (bound `q_end` = V, else 0: block-shaped masks from scalar flags).
    q_end = tl.where(rejected, V, 0)
    total = 0.0
    total_p = 0.0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < q_end, other=0.0).to(tl.float32)
        total += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        total_p += tl.sum(p, axis=0)
    use_residual = rejected & (total > 0)
    total = tl.where(use_residual, total, total_p)
    r_end = tl.where(use_residual, V, 0)
    threshold = tl.load(us_ptr + b).to(tl.float32) * total

    # Pass 2: first index whose running CDF exceeds u * total; else the last index with mass.
    running = 0.0
    found = V
    last_pos = 0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < r_end, other=0.0).to(tl.float32)
        w = tl.where(offs < r_end, tl.maximum(p - q, 0.0), p)
        cdf = running + tl.cumsum(w, axis=0)
        hit = tl.min(tl.where((cdf > threshold) & m, offs, V), axis=0)
        found = tl.minimum(found, hit)
        last_pos = tl.maximum(last_pos, tl.max(tl.where((w > 0) & m, offs, 0), axis=0))
        running += tl.sum(w, axis=0)
    tl.store(acc_ptr + b, acc)
    tl.store(next_ptr + b, tl.minimum(found, last_pos))


def sampling_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    B = cu_seqlens.numel() - 1
    p = target_probs.contiguous()
    V = p.shape[1]
    q = draft_probs.contiguous() if draft_probs.numel() else p.new_zeros(1, V)
    drafts = draft_tokens.contiguous() if draft_tokens.numel() else p.new_zeros(1, dtype=torch.long)
    ua = u_accept.contiguous() if u_accept.numel() else p.new_zeros(1)
    acc = torch.empty(B, dtype=torch.int32, device=p.device)
    nxt = torch.empty(B, dtype=torch.int32, device=p.device)
    _sampling_verify_kernel[(B,)](
        drafts, q, p, cu_seqlens.contiguous(), ua, u_sample.contiguous(), acc, nxt,
        V, q.stride(0), p.stride(0), BLOCK=BLOCK_V,
    )  # fmt: skip
    return acc.long(), nxt.long()
