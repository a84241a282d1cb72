"""Adaptive length head (DESIGN §1): how much of the drafted block is worth verifying.

â = sigmoid(w2 · mean_i SiLU(W1 h_i)) over the drafter's final hidden states h [k, H]; the target
then verifies k̂ = clamp(⌊γ·â·k⌋, 1, k) block positions (the anchor plus k̂-1 drafted tokens).
The head reads detached features, so its MSE loss never moves the drafter.

Label convention: a* = (accepted drafted tokens + 1) / k — "accepted incl. the bonus token" over
the block size — so a perfectly calibrated head verifies exactly the accepted drafts plus the
anchor (k̂ = accepted + 1), and k̂ = 1 degenerates to one autoregressive step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LengthHead(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int = 256) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, inner_size)
        self.out = nn.Linear(inner_size, 1)

    @property
    def inner_size(self) -> int:
        return self.proj.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, k, H] -> â [B] in [0, 1]."""
        pooled = F.silu(self.proj(hidden.detach())).mean(dim=1)
        return torch.sigmoid(self.out(pooled)).squeeze(-1)


def verify_lengths(a_hat: torch.Tensor, block_size: int, gamma: float = 1.0) -> torch.Tensor:
    """k̂ = clamp(⌊γ·â·k⌋, 1, k) as int64."""
    return torch.clamp(torch.floor(gamma * a_hat * block_size), 1, block_size).to(torch.long)


def acceptance_label(accepted_drafts: torch.Tensor, block_size: int) -> torch.Tensor:
    """a* for the length head's MSE: (accepted drafted tokens + 1) / k."""
    return (accepted_drafts.to(torch.float32) + 1.0) / block_size
