"""Drafter losses over the vocabulary — PyTorch reference (autograd does the backward).

Rows are block positions; each function returns one loss per row.
  hard CE       CE(q, x*)                     x* = the teacher's (target's) top-1 token
  clipped RKL   Σ_y min(q(y)·log(q(y)/p(y)), δ)  clipped per (position, vocab entry)
  forward KL    Σ_y p(y)·log(p(y)/q(y))         soft CE to the teacher
  rows          α·CE + (1−α)·KL, KL = clipped RKL ("opd") or forward KL ("fkl"); "ce" is α = 1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KL_KINDS = ("opd", "fkl", "ce")


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


def drafter_loss_rows(
    kind: str, logits: torch.Tensor, teacher_logprobs: torch.Tensor, alpha: float, delta: float
) -> torch.Tensor:
    ce = hard_ce(logits, teacher_logprobs.argmax(-1))
    if kind == "ce":
        return ce
    if kind == "opd":
        return alpha * ce + (1 - alpha) * clipped_reverse_kl(logits, teacher_logprobs, delta)
    if kind == "fkl":
        return alpha * ce + (1 - alpha) * forward_kl(logits, teacher_logprobs)
    raise ValueError(f"unknown loss {kind!r}: choose one of {', '.join(KL_KINDS)}")
