"""Drafter training losses (DESIGN §1). The per-row math lives in `adaflash.kernels` (a PyTorch
reference and a fused Triton kernel behind one dispatcher); this module adds the trainer's
conventions: loss names and DFlash's position-decay weights."""

from __future__ import annotations

from typing import Literal

import torch

from adaflash import kernels

LossName = Literal["ce", "opd", "fkl"]


def drafter_loss(
    name: LossName,
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    alpha: float = 0.8,
    delta: float = 0.01,
) -> torch.Tensor:
    """Per-row loss; x* is the teacher's argmax (the target's top-1 at that position)."""
    return kernels.drafter_loss_rows(name, logits, teacher_logprobs, alpha, delta)


def position_weights(
    block_size: int, decay: float | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Weights of draft positions 1..k-1: exp(-(i-1)/decay) (DFlash), or uniform."""
    i = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(i - 1) / decay) if decay else torch.ones_like(i)
