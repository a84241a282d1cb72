"""The batched bootstrap step is today's per-sequence step, computed at once.

`batch_block_loss` runs a step's sequences through one drafter forward and one LM-head matmul;
its loss, each sequence's loss, its gradients and its hit counts must equal those of the
per-sequence path (`stored_block_loss` on each sequence, divided by the batch size, backward one
by one) up to float rounding — with sequences of different lengths, fewer response positions
than anchors, blocks running past the sequence end, the vocabulary cut with sampled negatives,
and the top-k KL term. The trainer's two step modes then train the same drafter.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from adaflash.models.factory import new_drafter
from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer
from adaflash.training.feature_store import FeatureStore, build_store
from adaflash.training.losses import position_weights
from adaflash.training.offline import VocabCut, batch_block_loss, stored_block_loss
from adaflash.training.responses import Response

LAYERS = (1, 2)
BLOCK = 8


def _responses(n: int, seed: int) -> list[Response]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(97, 123) for _ in range(rng.randrange(3, 20))]
        # Some responses are shorter than a step's anchors, some far longer than the block.
        response = [rng.randrange(97, 123) for _ in range(rng.choice([4, 9, 30, 57]))]
        out.append(Response(f"toy/{seed}-{i}", "toy", prompt, response))
    return out


@pytest.fixture(scope="module")
def store(tiny32, tmp_path_factory) -> FeatureStore:
    return build_store(tiny32, _responses(24, 3), LAYERS, topk=4, root=tmp_path_factory.mktemp("fs"))


def _batch(store: FeatureStore, seed: int, seqs: int = 6, anchors: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in torch.randint(len(store), (seqs,), generator=g).tolist():
        seq = store[i]
        pool = torch.arange(seq.prompt_len, seq.tokens.numel() - 1)
        out.append((seq, pool[torch.randperm(pool.numel(), generator=g)[:anchors]].sort().values))
    return out


def _grads(drafter) -> list[torch.Tensor]:
    return [p.grad.clone() for p in drafter.parameters()]


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_batched_loss_and_gradients_equal_the_sequential_step(tiny32, store, kl_weight):
    torch.manual_seed(0)
    drafter, _ = new_drafter(tiny32, 2, BLOCK, target_layer_ids=LAYERS)
    weights = position_weights(BLOCK, 4.0)
    cut = VocabCut.from_tokens(tiny32.config.vocab_size, [store[i].tokens for i in range(8)])
    vocab = cut.with_negatives(16, torch.Generator().manual_seed(1))
    batch = _batch(store, seed=2)
    assert len({s.tokens.numel() for s, _ in batch}) > 1 and min(a.numel() for _, a in batch) < 16

    losses, correct, rows = [], 0, 0
    for seq, anchors in batch:
        out = stored_block_loss(drafter, tiny32.model, seq, anchors, weights, vocab, kl_weight)
        (out.loss / len(batch)).backward()
        losses.append(float(out.loss.detach()))
        correct, rows = correct + out.correct_at, rows + out.rows_at
    sequential = _grads(drafter)
    drafter.zero_grad(set_to_none=True)

    out = batch_block_loss(drafter, tiny32.model, batch, weights, vocab, kl_weight)
    out.loss.backward()
    torch.testing.assert_close(out.loss_per_seq, torch.tensor(losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float(out.loss.detach()), sum(losses) / len(losses), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct_at, correct) and torch.equal(out.rows_at, rows)
    for got, want in zip(_grads(drafter), sequential, strict=True):
        # Float rounding: summation order differs, so entries near 0 are compared at the tensor's scale.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def _trained(target, store: FeatureStore, out: Path, batch_step: bool) -> list[torch.Tensor]:
    cfg = BootstrapConfig(
        steps=3,
        num_layers=1,
        block_size=BLOCK,
        num_feature_layers=2,
        seqs_per_step=5,
        batch_step=batch_step,
        bf16=False,  # the float-rounding comparison is of the fp32 step
    )
    trainer = BootstrapTrainer(target, out, cfg)
    vocab = VocabCut.from_tokens(target.config.vocab_size, [store[i].tokens for i in range(len(store))])
    losses = []
    for _ in range(cfg.steps):
        losses.append(trainer._train_step(store, vocab)["loss"])
        trainer.state.step += 1
    return [torch.tensor(losses), *(p.detach().clone() for p in trainer.drafter.parameters())]


def test_trainer_step_modes_train_the_same_drafter(tiny32, store, tmp_path):
    layers = new_drafter(tiny32, 1, BLOCK, num_feature_layers=2)[0].config.target_layer_ids
    store = build_store(tiny32, _responses(24, 3), layers, root=tmp_path / "fs")
    batched = _trained(tiny32, store, tmp_path / "b", batch_step=True)
    sequential = _trained(tiny32, store, tmp_path / "s", batch_step=False)
    for got, want in zip(batched, sequential, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_max_train_len_trains_on_each_sequences_head_only(tiny32, store, tmp_path):
    """The sequence-length option: every sampled sequence is cut to its first N tokens (prompt
    first), features and teacher rows alike, and anchors stay inside the cut response."""
    seq = max((store[i] for i in range(len(store))), key=lambda s: s.tokens.numel())
    head = seq.head(seq.prompt_len + 5)
    assert head.tokens.numel() == seq.prompt_len + 5 and head.features.shape[0] == seq.prompt_len + 5
    assert torch.equal(head.tokens, seq.tokens[: seq.prompt_len + 5])
    assert head.topk_ids.shape[0] == head.topk_logp.shape[0] == seq.prompt_len + 5
    assert seq.head(10_000) is seq and seq.head(2).prompt_len == 2
    cfg = BootstrapConfig(steps=1, num_layers=1, block_size=BLOCK, num_feature_layers=2, max_train_len=24)
    trainer = BootstrapTrainer(tiny32, tmp_path / "cut", cfg)
    for step in range(4):
        for s, anchors in trainer._sample(store, step):
            assert s.tokens.numel() <= 24 and int(anchors.max()) < s.tokens.numel() - 1
