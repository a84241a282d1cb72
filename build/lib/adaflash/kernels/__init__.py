"""Verification and loss kernels behind one dispatcher.

The engine and the trainer call only the functions here. Each op has a PyTorch reference
(`verify.py`, `loss_reference.py`) and a Triton kernel (`triton_verify.py`, `triton_loss.py`):
Triton runs on CUDA tensors when the `kernels` extra is installed, the reference everywhere else.
`ADAFLASH_KERNELS=triton|reference` forces a backend (tests run the Triton kernels on CPU tensors
with `TRITON_INTERPRET=1`). `calls` counts (op, backend) pairs so tests can see the path taken.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import torch

from adaflash.kernels import loss_reference, verify
from adaflash.kernels.verify import draft_offsets

calls: Counter[tuple[str, str]] = Counter()


def backend_for(t: torch.Tensor) -> str:
    forced = os.environ.get("ADAFLASH_KERNELS", "auto")
    if forced in ("triton", "reference"):
        return forced
    if t.is_cuda and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "reference"


def _impl(op: str, t: torch.Tensor):
    backend = backend_for(t)
    calls[(op, backend)] += 1
    if backend == "triton":
        if op == "drafter_loss_rows":
            from adaflash.kernels import triton_loss

            return getattr(triton_loss, op)
        from adaflash.kernels import triton_verify

        return getattr(triton_verify, op)
    return getattr(loss_reference if op == "drafter_loss_rows" else verify, op)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], next token [B]) — see `verify.greedy_verify`."""
    return _impl("greedy_verify", target_logits)(draft_tokens, target_logits, cu_seqlens)


def sampling_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B], next token [B]) — see `verify.sampling_verify`."""
    fn = _impl("sampling_verify", target_probs)
    return fn(draft_tokens, draft_probs, target_probs, cu_seqlens, u_accept, u_sample)


def drafter_loss_rows(
    kind: str, logits: torch.Tensor, teacher_logprobs: torch.Tensor, alpha: float, delta: float
) -> torch.Tensor:
    """Per-row α·CE + (1−α)·KL — see `loss_reference.drafter_loss_rows`."""
    return _impl("drafter_loss_rows", logits)(kind, logits, teacher_logprobs, alpha, delta)


__all__ = ["backend_for", "calls", "draft_offsets", "drafter_loss_rows", "greedy_verify", "sampling_verify"]
