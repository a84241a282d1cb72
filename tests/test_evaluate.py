"""The simulated-decoding evaluation counts what it reports, and its groups pool exactly."""

from __future__ import annotations

import torch

from adaflash.training.blocks import block_hidden, sequence_pass
from adaflash.training.evaluate import evaluate_acceptance
from tests.conftest import make_bundle


def _planted(target, drafter, prompt: list[int], accepts: list[int]) -> list[int]:
    """A sequence on which the greedy walk from the first response token accepts exactly
    `accepts[r]` drafts in round r: each round appends the drafter's own first drafts, then a
    token it did not draft (the drafts depend only on the tokens up to the anchor)."""
    layers = drafter.config.target_layer_ids
    seq = [*prompt, 97]
    for acc in accepts:
        sp = sequence_pass(target.model, [seq], layers)[0]
        with torch.no_grad():
            hidden, _, _ = block_hidden(drafter, target.model, sp, torch.tensor([len(seq) - 1]))
            pred = target.model.logits(hidden[0, 1:]).argmax(-1).tolist()
        seq += pred[:acc] + [(pred[acc] + 1) % 256]
    return seq


def test_walk_counts_planted_acceptance_and_per_sequence_counts_pool_to_all(tiny32):
    bundle = make_bundle(tiny32, block_size=8)
    prompts = [[256, 104, 105], [256, 120, 121, 122], [256, 111]]
    plans = [[3, 0, 6, 1], [0, 0, 2], [5, 4]]
    seqs = [_planted(tiny32, bundle.drafter, p, a) for p, a in zip(prompts, plans, strict=True)]
    passes = sequence_pass(tiny32.model, seqs, bundle.drafter.config.target_layer_ids)
    starts = [len(p) for p in prompts]
    names = [f"s{i}" for i in range(len(seqs))]
    rep = evaluate_acceptance(bundle.drafter, tiny32.model, passes, starts, names, bundle.length_head)

    for name, seq, start, plan in zip(names, seqs, starts, plans, strict=True):
        row = rep[name]
        # Full-block verification accepts exactly the planted drafts, round by round.
        assert row["dflash_rounds"] == len(plan) and row["dflash_tokens"] == sum(plan) + len(plan)
        assert row["dflash_tau"] == round(row["dflash_tokens"] / row["dflash_rounds"], 4)
        # k̂ can only cut rounds short: more rounds over the same continuation.
        assert row["adaflash_tokens"] == len(seq) - 1 - start == row["dflash_tokens"]
        assert row["adaflash_rounds"] >= row["dflash_rounds"]
        assert row["adaflash_tau"] == round(row["adaflash_tokens"] / row["adaflash_rounds"], 4)
    # One batched walk over all sequences counts what the per-sequence walks count, in total and
    # per sequence (`per_sequence`); a domain that holds every sequence is the "all" row.
    one = evaluate_acceptance(
        bundle.drafter, tiny32.model, passes, starts, ["x"] * len(seqs), bundle.length_head, per_sequence=True
    )
    assert one["x"] == one["all"]
    for key in ("dflash_rounds", "dflash_tokens", "adaflash_rounds", "adaflash_tokens"):
        assert sum(rep[n][key] for n in names) == rep["all"][key] == one["all"][key], key
        assert one["all"]["per_sequence"][key] == [rep[n][key] for n in names], key
