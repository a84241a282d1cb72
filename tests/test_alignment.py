"""Training and decoding agree on labels, anchors, context masks and feature layers.

A learnable toy on the `tiny` target: each sequence is a random 12-letter span followed by that
span repeated, so every drafted token can be copied from the context (the target's features of
earlier positions). A drafter trained through the real path (feature store -> offline steps)
must reach >= 0.9 acceptance at draft position 1 and > 0.5 at position 4 in the same simulated
decoding the bootstrap reports, and match prompt lookup (the n-gram baseline) on the same
sequences. The same training with labels shifted by one position — the bug two public DFlash
trainers shipped — must fail that bar.
"""

from __future__ import annotations

import random

import pytest
import torch

import adaflash.training.blocks as blocks
from adaflash.models.factory import new_drafter
from adaflash.training.blocks import SequencePass
from adaflash.training.evaluate import evaluate_acceptance
from adaflash.training.feature_store import build_store
from adaflash.training.losses import position_weights
from adaflash.training.offline import VocabCut, lr_at, stored_block_loss
from adaflash.training.responses import Response

LAYERS = (1, 2)
BLOCK = 8


def _copy_corpus(n: int, seed: int, period: int = 12, repeats: int = 4) -> list[Response]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = [rng.randrange(97, 123) for _ in range(period)]
        out.append(Response(f"toy/{seed}-{i}", "toy", [256, *span], span * repeats))
    return out


def _train_and_evaluate(target, tmp_path, steps: int = 500) -> dict:
    store = build_store(target, _copy_corpus(200, 1), LAYERS, root=tmp_path)
    held = build_store(target, _copy_corpus(24, 2), LAYERS, root=tmp_path)
    torch.manual_seed(0)
    drafter, _ = new_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, init_from_target=False)
    vocab = VocabCut.full(target.config.vocab_size)
    weights = position_weights(BLOCK, 4.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3, 0.04)
        opt.zero_grad()
        for i in torch.randint(len(store), (4,), generator=g).tolist():
            seq = store[i]
            pool = torch.arange(seq.prompt_len, seq.tokens.numel() - 1)
            anchors = pool[torch.randperm(pool.numel(), generator=g)[:32]].sort().values
            (stored_block_loss(drafter, target.model, seq, anchors, weights, vocab).loss / 4).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
    seqs = [held[i] for i in range(len(held))]
    return evaluate_acceptance(
        drafter,
        target.model,
        [SequencePass(s.tokens, s.features, None) for s in seqs],
        [s.prompt_len for s in seqs],
        [s.domain for s in seqs],
        ngram=True,
    )["all"]


def test_drafter_learns_to_copy_and_matches_ngram(tiny32, tmp_path):
    row = _train_and_evaluate(tiny32, tmp_path)
    acc = row["accept_rate_by_position"]
    assert acc[0] >= 0.9 and acc[3] > 0.5, row
    # The copy test: a drafter reading the target's features copies at least as well as lookup.
    assert row["dflash_tau"] >= row["ngram_tau"] - 0.05, row


def test_shifted_labels_fail_the_bar(tiny32, tmp_path, monkeypatch):
    real = blocks.block_inputs

    def shifted(tokens, anchors, k, mask_token_id):
        block, positions, labels = real(tokens, anchors, k, mask_token_id)
        return block, positions, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -1)], 1)

    monkeypatch.setattr(blocks, "block_inputs", shifted)
    row = _train_and_evaluate(tiny32, tmp_path, steps=300)
    assert row["accept_rate_by_position"][0] < 0.5, row


@pytest.mark.parametrize(
    "tail,count,want", [([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]), ([5, 6, 7], 2, []), ([1, 2, 1], 4, [2, 1])]
)
def test_ngram_proposals(tail, count, want):
    from adaflash.models.ngram import propose

    assert propose(tail, count) == want
