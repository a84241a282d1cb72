"""Offline drafter steps on stored target features (no target forward per step).

Conventions, checked against the decoder (`evaluate._walk`, `serving`) and the reference
`dflash` package's `spec_generate`: a block anchored at position p holds [x_p, MASK x (k-1)] at
positions p .. p+k-1; its queries see the context features of positions 0 .. p-1 (the anchor is
the newest committed token, whose target features do not exist yet when it is drafted from) and
the whole block; the label of block slot i (1 <= i < k) is x_{p+i}, the target's greedy token at
that position. `tests/test_alignment.py` trains a drafter on a learnable toy and fails if any of
these is off by one (it shows a label shift of +1 dropping acceptance to near 0).

The LM head is the cost on a CPU (49k x 576 per row, x3 with backward). `VocabCut` restricts the
training softmax to the token ids that occur as labels in the training data (plus specials) and a
fresh random sample of the other ids each step (sampled negatives: without them an id no label
uses keeps whatever logit it has and can win the full-vocabulary argmax — measured on `tiny`,
whose greedy text uses 14 ids: acceptance 0). The evaluation always decodes over the full
vocabulary, so a rogue out-of-set id shows up as a rejection, not as a hidden gain.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaflash.models.drafter import Drafter
from adaflash.models.transformer import TargetModel
from adaflash.training.blocks import batch_block_hidden, block_hidden
from adaflash.training.feature_store import StoredSequence


@dataclass
class VocabCut:
    """Training-softmax vocabulary: `ids` [V'] kept, `index` [V] position in ids or -1."""

    ids: torch.Tensor
    index: torch.Tensor

    @classmethod
    def from_tokens(
        cls, vocab_size: int, token_lists: Iterable[torch.Tensor], extra: Iterable[int] = ()
    ) -> VocabCut:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        for toks in token_lists:
            seen[toks] = True
        for t in extra:
            seen[int(t)] = True
        ids = seen.nonzero().squeeze(1)
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        return cls(ids, index)

    @classmethod
    def full(cls, vocab_size: int) -> VocabCut:
        ids = torch.arange(vocab_size)
        return cls(ids, ids.clone())

    def to(self, device: torch.device) -> VocabCut:
        return self if self.ids.device == device else VocabCut(self.ids.to(device), self.index.to(device))

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def with_negatives(self, count: int, generator: torch.Generator) -> VocabCut:
        """This cut plus `count` random ids from outside it (one step's sampled negatives), so the
        logits of ids no label uses are pushed down too and cannot win the full-vocab argmax."""
        V = self.index.numel()
        dev = self.index.device
        outside = (self.index < 0).nonzero().squeeze(1)
        if count <= 0 or outside.numel() == 0:
            return self
        # The generator lives on the CPU (reproducible on every device); the picks move over.
        pick = outside[torch.randperm(outside.numel(), generator=generator)[:count].to(dev)]
        ids = torch.cat([self.ids, pick])
        index = torch.full((V,), -1, dtype=torch.long, device=dev)
        index[ids] = torch.arange(ids.numel(), device=dev)
        return VocabCut(ids, index)


@dataclass
class StepOut:
    loss: torch.Tensor  # weighted CE (with grad)
    correct_at: torch.Tensor  # [k-1] top-1 hits per draft position (training-vocab argmax)
    rows_at: torch.Tensor  # [k-1] supervised rows per position
    loss_per_seq: torch.Tensor | None = None  # [B] (batched step): each sequence's loss


def stored_block_loss(
    drafter: Drafter,
    target: TargetModel,
    seq: StoredSequence,
    anchors: torch.Tensor,
    weights: torch.Tensor,
    vocab: VocabCut,
    kl_weight: float = 0.0,
) -> StepOut:
    """Position-weighted hard CE to the target's greedy tokens (+ optional top-k forward KL).

    `weights` [k-1]: DFlash's decay exp(-(i-1)/γ) per draft position (the anchor slot carries no
    loss). With `kl_weight` > 0 the store's teacher top-k log-probs add a forward-KL term on the
    teacher's top-k ids (renormalised), restricted to ids inside the training vocabulary.
    """
    hidden, labels, positions = block_hidden(drafter, target, seq, anchors)
    full = labels >= 0
    teacher = None
    if kl_weight > 0 and seq.topk_ids is not None:
        pos = positions[:, 1:][full]  # absolute label positions; row j of the store predicts j+1
        teacher = seq.topk_ids[pos - 1], seq.topk_logp[pos - 1]
    w_head = target.lm_head.weight[vocab.ids]
    per_row, pos_w, correct_at, rows_at = _row_losses(
        hidden, labels, w_head, vocab, weights, teacher, kl_weight
    )
    loss = (per_row * pos_w).sum() / pos_w.sum().clamp_min(1e-9)
    return StepOut(loss, correct_at, rows_at)


def batch_block_loss(
    drafter: Drafter,
    target: TargetModel,
    batch: list[tuple[StoredSequence, torch.Tensor]],
    weights: torch.Tensor,
    vocab: VocabCut,
    kl_weight: float = 0.0,
) -> StepOut:
    """The mean over `batch`'s (sequence, anchors) of `stored_block_loss`, in one drafter forward
    and one LM-head matmul: each sequence keeps its own position-weighted mean, so the loss and
    its gradients equal the sequential step's up to float rounding (tests/test_bootstrap_batch.py).
    `StepOut.loss_per_seq` holds each sequence's loss."""
    seqs = [s for s, _ in batch]
    blocks = batch_block_hidden(drafter, target, seqs, [a for _, a in batch])
    labels, seq_of = blocks.labels, blocks.seq_of
    full = labels >= 0
    teacher = None
    if kl_weight > 0 and all(s.topk_ids is not None for s in seqs):
        offsets = torch.tensor([0, *(s.tokens.numel() for s in seqs[:-1])], device=labels.device).cumsum(0)
        pos = (offsets[seq_of][:, None] + blocks.positions[:, 1:])[full]
        teacher = (
            torch.cat([s.topk_ids for s in seqs])[pos - 1],
            torch.cat([s.topk_logp for s in seqs])[pos - 1],
        )
    w_head = target.lm_head.weight[vocab.ids]
    per_row, pos_w, correct_at, rows_at = _row_losses(
        blocks.hidden, labels, w_head, vocab, weights, teacher, kl_weight
    )
    row_seq = seq_of[:, None].expand_as(labels)[full]
    num = per_row.new_zeros(len(batch)).index_add(0, row_seq, per_row * pos_w)
    den = pos_w.new_zeros(len(batch)).index_add(0, row_seq, pos_w)
    per_seq = num / den.clamp_min(1e-9)
    return StepOut(per_seq.mean(), correct_at, rows_at, per_seq.detach())


def accumulate_step(
    drafter: Drafter,
    target: TargetModel,
    batch: list[tuple[StoredSequence, torch.Tensor]],
    weights: torch.Tensor,
    vocab: VocabCut,
    kl_weight: float = 0.0,
    batched: bool = True,
    bf16: bool = False,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of `batch`'s mean per-sequence loss: one batched forward/backward,
    or one per sequence (`batched=False`: the same objective, one small forward each). Returns the
    summed sequence losses and the top-1 hits and rows per draft position (on the host)."""
    k = drafter.block_size
    total, correct, rows = 0.0, torch.zeros(k - 1), torch.zeros(k - 1)
    device = weights.device.type
    for part in ([batch] if batched else [[one] for one in batch]) if batch else []:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            out = batch_block_loss(drafter, target, part, weights, vocab, kl_weight)
        (out.loss * (len(part) / len(batch))).backward()
        total += float(out.loss_per_seq.sum())
        correct += out.correct_at.cpu()
        rows += out.rows_at.cpu()
    return total, correct, rows


def _row_losses(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    w_head: torch.Tensor,
    vocab: VocabCut,
    weights: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    kl_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per supervised row (labels >= 0, in row-major block order): the loss, its position weight;
    and top-1 hits and rows per draft position. `teacher`: top-k (ids, log-probs) per row."""
    full = labels >= 0
    rows = hidden[:, 1:][full]
    logits = (rows @ w_head.to(rows.dtype).T).float()
    # Labels outside the cut (-1) carry no CE (ignore_index gives their rows 0 without copying
    # the kept rows of the widest tensor of the step).
    per_row = F.cross_entropy(logits, vocab.index[labels[full]], ignore_index=-1, reduction="none")
    if teacher is not None:
        t_ids, t_logp = teacher
        t_idx = vocab.index[t_ids]
        ok = t_idx >= 0
        p = torch.where(ok, t_logp.exp(), torch.zeros_like(t_logp))
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        logq = F.log_softmax(logits, -1).gather(1, t_idx.clamp_min(0))
        per_row = (1 - kl_weight) * per_row + kl_weight * -(p * logq).sum(-1)
    pos_w = weights[None, :].expand_as(labels)[full]
    with torch.no_grad():
        pred = torch.full_like(labels, -2)
        pred[full] = vocab.ids[logits.argmax(-1)]
        hit = (pred == labels) & full
    return per_row, pos_w, hit.sum(0), full.sum(0)


def lr_at(step: int, total: int, peak: float, warmup_frac: float, floor: float = 0.1) -> float:
    """Linear warm-up then cosine decay to floor*peak."""
    import math

    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
