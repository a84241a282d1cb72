"""Drafter losses (DESIGN §1). Rows are block positions; every function returns a loss per row so
callers can weight positions (DFlash's position decay) and mask rows past a sequence's end.

  hard CE           ℓ_hard = CE(q_w, x*)            x* = the target's top-1 token
  clipped RKL       Σ_y min(q(y)·log(q(y)/p(y)), δ)  clipped per (position, vocab entry)
  forward KL        Σ_y p(y)·log(p(y)/q(y))          soft CE to the teacher (OSD-style / bootstrap)
  OPD               α·ℓ_hard + (1−α)·ℓ_rkl^clip      defaults α = 0.8, δ = 0.01
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LossName = Literal["ce", "opd", "fkl"]


def hard_ce(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target_ids, reduction="none")


def clipped_reverse_kl(logits: torch.Tensor, teacher_logprobs: torch.Tensor, delta: float) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)
    terms = logq.exp() * (logq - teacher_logprobs.float())
    return torch.clamp(terms, max=delta).sum(-1)


def forward_kl(logits: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)
    logp = teacher_logprobs.float()
    return (logp.exp() * (logp - logq)).sum(-1)


def drafter_loss(
    name: LossName,
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    alpha: float = 0.8,
    delta: float = 0.01,
) -> torch.Tensor:
    """Per-row loss; x* is the teacher's argmax (the target's top-1 at that position)."""
    x_star = teacher_logprobs.argmax(-1)
    ce = hard_ce(logits, x_star)
    if name == "ce":
        return ce
    if name == "opd":
        return alpha * ce + (1 - alpha) * clipped_reverse_kl(logits, teacher_logprobs, delta)
    if name == "fkl":
        return alpha * ce + (1 - alpha) * forward_kl(logits, teacher_logprobs)
    raise ValueError(f"unknown loss {name!r}")


def position_weights(block_size: int, decay: float | None) -> torch.Tensor:
    """Weights of draft positions 1..k-1: exp(-(i-1)/decay) (DFlash), or uniform."""
    i = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(i - 1) / decay) if decay else torch.ones_like(i)
