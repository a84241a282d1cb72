"""The shipped form of a bootstrapped drafter (the repo's `drafters/<target>/`, our model hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from adaflash.models.checkpoint import load_drafter_for, save_drafter
from adaflash.models.targets import Target
from adaflash.training.bootstrap import METRICS


def release(src: Path, dst: Path, target: Target) -> Path:
    """Copy a bootstrapped drafter to a shippable directory: fp16 weights, length head, metadata,
    model card, metrics and plot; no training state (the repo's `drafters/<target>/`)."""
    bundle = load_drafter_for(src, target, dtype=torch.float32)
    extra = {
        name: (src / name).read_bytes()
        for name in ("README.md", METRICS, "tau_vs_budget.png")
        if (src / name).exists()
    }
    return save_drafter(
        dst, bundle.drafter, bundle.length_head, bundle.meta, torch.float16, extra, bundle.draft_vocab
    )
