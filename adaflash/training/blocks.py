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


@dataclass
class BlockBatch:
    """The blocks of several sequences, in sequence order (see `batch_block_hidden`)."""

    hidden: torch.Tensor  # [N, k, H] drafter hidden states (with grad)
    labels: torch.Tensor  # [N, k-1]
    positions: torch.Tensor  # [N, k] absolute positions in the block's own sequence
    seq_of: torch.Tensor  # [N] index of the block's sequence


def batch_block_hidden(
    drafter: Drafter,
    target: TargetModel,
    seqs: list[SequencePass] | list[StoredSequence],
    anchors: list[torch.Tensor],
) -> BlockBatch:
    """`block_hidden` for the blocks of several sequences in one drafter forward: the same
    per-block math, with a few large matmuls instead of many small ones per sequence.

    Each sequence's context (positions 0 .. max anchor - 1) is projected once, packed back to
    back (`fc`, the norm, the k/v projections and RoPE act per token, so packing changes no
    value), then padded to the longest context. Each sequence's blocks sit side by side in one
    row of queries that sees its own context below each block's anchor and, of the row, only
    its own block; the padding is never visible to a real query."""
    k = drafter.block_size
    dev = anchors[0].device
    dtype = drafter.fc.weight.dtype
    spans = [int(a.max()) for a in anchors]
    S, A = max(spans), max(a.numel() for a in anchors)
    feats = torch.cat([s.features[:n].to(dtype) for s, n in zip(seqs, spans, strict=True)])
    kv = drafter.context_kv(feats[None], torch.cat([torch.arange(n, device=dev) for n in spans])[None])
    starts = torch.tensor([0, *spans[:-1]], device=dev).cumsum(0)
    # Rows past a sequence's own span point into the next one's context; the mask hides them.
    rows = (starts[:, None] + torch.arange(S, device=dev)[None, :]).clamp_max(feats.shape[0] - 1)
    kv = [(kk[0][:, rows].transpose(0, 1), vv[0][:, rows].transpose(0, 1)) for kk, vv in kv]
    mask_id = drafter.config.mask_token_id
    parts = [block_inputs(s.tokens, a, k, mask_id) for s, a in zip(seqs, anchors, strict=True)]
    valid = (
        torch.arange(A, device=dev)[None, :] < torch.tensor([a.numel() for a in anchors], device=dev)[:, None]
    )
    block = torch.full((len(seqs), A, k), mask_id, device=dev)
    positions = torch.zeros(len(seqs), A, k, dtype=torch.long, device=dev)
    block[valid], positions[valid] = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    anchor = positions[:, :, :1].expand(-1, -1, k).reshape(len(seqs), A * k, 1)
    visible = torch.arange(S, device=dev)[None, None, :] < anchor  # padded blocks: anchor 0, none
    own = torch.arange(A * k, device=dev) // k
    own = (own[:, None] == own[None, :])[None].expand(len(seqs), -1, -1)
    embeds = target.embed(block.view(len(seqs), A * k)).to(dtype)
    hidden = drafter(embeds, positions.view(len(seqs), A * k), kv, visible, own)
    seq_of = torch.arange(len(seqs), device=dev)[:, None].expand(-1, A)[valid]
    return BlockBatch(
        hidden.view(len(seqs), A, k, -1)[valid], torch.cat([p[2] for p in parts]), positions[valid], seq_of
    )


def accepted_prefix(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Counterfactual accepted drafts per block: longest prefix with pred == label."""
    return (pred == labels).long().cumprod(dim=1).sum(dim=1)
