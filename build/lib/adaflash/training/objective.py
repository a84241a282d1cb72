"""The per-sequence training objective shared by the offline bootstrap and the online trainer.

For the blocks anchored at `anchors` of one target pass: drafter loss over the block positions
(hard CE / OPD / forward KL, DESIGN §1, weighted by DFlash's position decay) plus the length
head's MSE to the uncensored label a* — the counterfactual acceptance of the *full* block of the
drafter being trained against the target's top-1, never the served k̂-truncated verify. The head
reads detached hidden states, so its loss leaves the drafter's gradients untouched.

`osd` is the OSD baseline: forward KL (soft CE to the teacher) only on the positions the served
round rejected (after its accepted prefix); anchors without a served round train on every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from adaflash.models.drafter import Drafter
from adaflash.models.length_head import LengthHead, acceptance_label
from adaflash.models.transformer import TargetModel
from adaflash.training.blocks import SequencePass, accepted_prefix, block_hidden
from adaflash.training.losses import drafter_loss

ObjectiveName = Literal["ce", "fkl", "opd", "osd"]


@dataclass(frozen=True)
class Objective:
    loss: ObjectiveName = "opd"
    alpha: float = 0.8  # weight of hard CE in the mixture
    delta: float = 0.01  # per-(position, vocab entry) clip of the reverse-KL terms


@dataclass
class BlockLosses:
    drafter: torch.Tensor  # scalar, with grad into the drafter
    head: torch.Tensor  # scalar, with grad into the length head only
    accepted: torch.Tensor  # [A] counterfactual accepted drafts of the trained drafter
    rows: int  # supervised (block position) rows


def block_objective(
    drafter: Drafter,
    head: LengthHead,
    target: TargetModel,
    sp: SequencePass,
    anchors: torch.Tensor,
    objective: Objective,
    weights: torch.Tensor,
    served_accepted: torch.Tensor | None = None,
) -> BlockLosses:
    """`weights` [k-1] per draft position; `served_accepted` [A] (-1: no served round) for `osd`."""
    k = drafter.block_size
    hidden, labels, positions = block_hidden(drafter, target, sp, anchors)
    full = labels >= 0
    # The LM head dominates the cost: one pass over every in-sequence row serves both the loss
    # rows and the counterfactual acceptance.
    logits = target.logits(hidden[:, 1:][full])
    teacher = sp.teacher_logprobs[(positions[:, 1:] - 1)[full]]
    use = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    if objective.loss == "osd" and served_accepted is not None:
        pos = torch.arange(1, k, device=labels.device)[None, :].expand_as(labels)
        rejected = (served_accepted[:, None] < 0) | (pos > served_accepted[:, None])
        use = rejected[full]
    if objective.loss == "osd":
        per_row = drafter_loss("fkl", logits[use], teacher[use], alpha=0.0)
    else:
        per_row = drafter_loss(objective.loss, logits[use], teacher[use], objective.alpha, objective.delta)
    w = weights[None, :].expand_as(labels)[full][use]
    loss = (per_row * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        pred = torch.full_like(labels, -2)
        pred[full] = logits.argmax(-1)
        x_star = torch.full_like(labels, -1)
        x_star[full] = teacher.argmax(-1)
        accepted = accepted_prefix(pred, x_star)
    head_loss = F.mse_loss(head(hidden), acceptance_label(accepted, k).to(hidden.dtype))
    return BlockLosses(loss, head_loss, accepted, int(use.sum()))
