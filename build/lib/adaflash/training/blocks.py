"""Target supervision and drafter blocks over whole sequences.

The target runs once per sequence (`sequence_pass`); many anchor blocks then share that pass:
block a starts at anchor position p_a, sees the context features of positions < p_a, and
predicts tokens p_a+1 .. p_a+k-1 (DESIGN §1, "many anchors per sequence").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaflash.models.drafter import Drafter
from adaflash.models.generate import pad_batch
from adaflash.models.transformer import TargetModel
from adaflash.training.feature_store import StoredSequence


@dataclass
class SequencePass:
    tokens: torch.Tensor  # [L]
    features: torch.Tensor  # [L, n*H] fp16 (SmolLM2 outliers ~2.5e4 overflow bf16's precision)
    teacher_logprobs: torch.Tensor | None  # [L, V]: row j = target log p(token j+1 | ..j)


@torch.no_grad()
def sequence_pass(
    target: TargetModel,
    sequences: list[list[int]],
    layer_ids: tuple[int, ...],
    teacher_from: list[int] | None = None,
) -> list[SequencePass]:
    """One padded target forward over the sequences; features for all positions and, when
    `teacher_from[i]` is given, teacher log-probs for rows teacher_from[i]-1 .. L-2 (others 0)."""
    tokens, lengths = pad_batch(sequences)
    tokens = tokens.to(target.embed_tokens.weight.device)  # the target's device: CPU, or the step's GPU
    cache = target.new_cache(len(sequences), tokens.shape[1] + 1)
    out = target(tokens, cache, capture_layers=layer_ids)
    passes = []
    for i, seq in enumerate(sequences):
        L = len(seq)
        teacher = None
        if teacher_from is not None:
            start = max(teacher_from[i] - 1, 0)
            teacher = torch.zeros(L, target.config.vocab_size, dtype=torch.float32, device=tokens.device)
            teacher[start : L - 1] = F.log_softmax(
                target.logits(out.hidden[i, start : L - 1]).float(), dim=-1
            )
        passes.append(SequencePass(tokens[i, :L].clone(), out.features[i, :L].to(torch.float16), teacher))
    return passes


def block_inputs(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens [A, k] = [x_p, MASK...], positions [A, k], and labels [A, k-1] (x_{p+i},
    -1 past the sequence end)."""
    L = tokens.numel()
    offs = torch.arange(block_size, device=tokens.device)
    positions = anchors[:, None] + offs[None, :]
    block = torch.full_like(positions, mask_token_id)
    block[:, 0] = tokens[anchors]
    label_pos = positions[:, 1:]
    labels = torch.where(label_pos < L, tokens[label_pos.clamp_max(L - 1)], -1)
    return block, positions, labels


def block_hidden(
    drafter: Drafter,
    target: TargetModel,
    seq: SequencePass | StoredSequence,
    anchors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafter hidden states [A, k, H] for blocks at `anchors` of one sequence (with grad): a
    live target pass or a feature-store sequence (only `tokens` and `features` are read)."""
    k = drafter.block_size
    block, positions, labels = block_inputs(seq.tokens, anchors, k, drafter.config.mask_token_id)
    span = int(anchors.max())
    ctx_pos = torch.arange(span, device=anchors.device)[None, :]
    dtype = drafter.fc.weight.dtype
    kv = drafter.context_kv(seq.features[None, :span].to(dtype), ctx_pos)
    A = anchors.numel()
    kv = [(kk.expand(A, -1, -1, -1), vv.expand(A, -1, -1, -1)) for kk, vv in kv]
    visible = (ctx_pos < anchors[:, None])[:, None, :].expand(A, k, span)
    hidden = drafter(target.embed(block).to(dtype), positions, kv, visible)
    return hidden, labels, positions


def accepted_prefix(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Counterfactual accepted drafts per block: longest prefix with pred == label."""
    return (pred == labels).long().cumprod(dim=1).sum(dim=1)
