"""Fused drafter loss in Triton: α·CE(q, x*) + (1−α)·KL with its backward, one program per row,
streaming over vocabulary blocks. Nothing of size [rows × vocab] is materialised besides the
logits and their gradient (PyTorch's version keeps log q, q, the clipped terms and their
gradients — several copies at 152k vocabulary).

KL = Σ_y min(q·(log q − log p), δ) (clipped reverse KL, "opd"), or Σ_y p·(log p − log q) ("fkl").
Gradients w.r.t. the logits z (q = softmax z, s_y = log q_y − log p_y, m_y = [q_y s_y ≤ δ]):
  CE:            q_j − [j = x*]
  clipped RKL:   q_j·(m_j·(s_j + 1) − A),  A = Σ_y m_y q_y (s_y + 1)
  forward KL:    q_j − p_j
The forward saves logZ, x* and A per row so the backward is one more streaming pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
KL_OPD, KL_FKL, KL_NONE = 0, 1, 2


@triton.jit
def _loss_fwd_kernel(
    z_ptr, lp_ptr, loss_ptr, logz_ptr, xstar_ptr, a_ptr, V, stride_z, stride_lp,
    alpha, delta, KL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * stride_z
    lp_row = lp_ptr + r * stride_lp
    # Pass 1: online log-sum-exp of z and argmax of the teacher.
    m_run = -float("inf")
    s_run = 0.0
    t_best = -float("inf")
    x_star = 0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_run, tl.max(z, axis=0))
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m_run = m_new
        lp = tl.load(lp_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        t_max = tl.max(lp, axis=0)
        t_idx = tl.min(tl.where(lp == t_max, offs, V), axis=0)
        better = t_max > t_best
        x_star = tl.where(better, t_idx, x_star)
        t_best = tl.where(better, t_max, t_best)
    logz = m_run + tl.log(s_run)
    ce = logz - tl.load(z_row + x_star).to(tl.float32)
    # Pass 2: the KL term (and A, the clipped-RKL backward's row constant).
    kl = 0.0
    a = 0.0
    if KL != 2:
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
            lp = tl.load(lp_row + offs, mask=mask, other=0.0).to(tl.float32)
            logq = z - logz
            q = tl.exp(logq)
            if KL == 0:
                t = q * (logq - lp)
                keep = (t <= delta) & mask
                kl += tl.sum(tl.where(mask, tl.minimum(t, delta), 0.0), axis=0)
                a += tl.sum(tl.where(keep, q * (logq - lp + 1.0), 0.0), axis=0)
            else:
                p = tl.exp(lp)
                kl += tl.sum(tl.where(mask & (p > 0), p * (lp - logq), 0.0), axis=0)
    tl.store(loss_ptr + r, alpha * ce + (1.0 - alpha) * kl)
    tl.store(logz_ptr + r, logz)
    tl.store(xstar_ptr + r, x_star)
    tl.store(a_ptr + r, a)


@triton.jit
def _loss_bwd_kernel(
    z_ptr, lp_ptr, g_ptr, logz_ptr, xstar_ptr, a_ptr, dz_ptr, V, stride_z, stride_lp, stride_dz,
    alpha, delta, KL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + r).to(tl.float32)
    logz = tl.load(logz_ptr + r)
    x_star = tl.load(xstar_ptr + r)
    a = tl.load(a_ptr + r)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(z_ptr + r * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
        logq = z - logz
        q = tl.exp(logq)
        grad = alpha * (q - tl.where(offs == x_star, 1.0, 0.0))
        if KL == 0:
            lp = tl.load(lp_ptr + r * stride_lp + offs, mask=mask, other=0.0).to(tl.float32)
            s = logq - lp
            keep = q * s <= delta
            grad += (1.0 - alpha) * q * (tl.where(keep, s + 1.0, 0.0) - a)
        elif KL == 1:
            lp = tl.load(lp_ptr + r * stride_lp + offs, mask=mask, other=-float("inf")).to(tl.float32)
            grad += (1.0 - alpha) * (q - tl.exp(lp))
        tl.store(dz_ptr + r * stride_dz + offs, (g * grad).to(dz_ptr.dtype.element_ty), mask=mask)


_KL = {"opd": KL_OPD, "fkl": KL_FKL, "ce": KL_NONE}


class _FusedDrafterLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher_logprobs, kind: int, alpha: float, delta: float):
        z = logits.contiguous()
        lp = teacher_logprobs.contiguous()
        R, V = z.shape
        dev = z.device
        loss = torch.empty(R, dtype=torch.float32, device=dev)
        logz = torch.empty(R, dtype=torch.float32, device=dev)
        xstar = torch.empty(R, dtype=torch.int32, device=dev)
        a = torch.empty(R, dtype=torch.float32, device=dev)
        if R:
            _loss_fwd_kernel[(R,)](
                z, lp, loss, logz, xstar, a, V, z.stride(0), lp.stride(0), float(alpha), float(delta),
                KL=kind, BLOCK=BLOCK_V,
            )  # fmt: skip
        ctx.save_for_backward(z, lp, logz, xstar, a)
        ctx.kind, ctx.alpha, ctx.delta = kind, alpha, delta
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        z, lp, logz, xstar, a = ctx.saved_tensors
        R, V = z.shape
        dz = torch.empty_like(z)
        if R:
            _loss_bwd_kernel[(R,)](
                z, lp, grad_loss.contiguous(), logz, xstar, a, dz, V, z.stride(0), lp.stride(0),
                dz.stride(0), float(ctx.alpha), float(ctx.delta), KL=ctx.kind, BLOCK=BLOCK_V,
            )  # fmt: skip
        return dz, None, None, None, None


def drafter_loss_rows(
    kind: str, logits: torch.Tensor, teacher_logprobs: torch.Tensor, alpha: float, delta: float
) -> torch.Tensor:
    if kind not in _KL:
        raise ValueError(f"unknown loss {kind!r}")
    a = 1.0 if kind == "ce" else alpha
    return _FusedDrafterLoss.apply(logits, teacher_logprobs, _KL[kind], a, delta)
