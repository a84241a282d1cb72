"""The cost curves' seed: timed forwards at engine start-up (`adaflash-cost` reads the curves;
every step then corrects them with its measured time, `CostPolicy.observe_step`)."""

from __future__ import annotations

from functools import partial

import torch

from adaflash.serving.policy import CostPolicy
from adaflash.serving.proposer import clock
from adaflash.serving.runner import PackedBatch, PackedRunner, Segment


@torch.no_grad()
def calibrate(policy: CostPolicy, runner: PackedRunner, max_rows: int, repeats: int = 3) -> None:
    """Seed the cost curves with timed forwards on free slots (engine start-up): decode-like
    rows after a context. Sizes are timed round-robin and the fastest run of each is kept:
    on a shared machine noise only adds, and drifts hit every size alike."""
    top = min(max_rows, 512, runner.capacity // 2)
    ctx = min(256, runner.capacity - top - 1)

    def target(requests: int, width: int) -> None:
        segments = [Segment(i, ctx, [0] * width) for i in range(requests)]
        h, _ = runner.forward(PackedBatch.build(segments))
        policy.model.logits(h)

    runner.forward(PackedBatch.build([Segment(0, 0, [0] * (ctx + 1))]))  # context + warm-up
    cost = policy.costs.target
    # One request's rows (a verify, a prefill), then R requests x w rows each (decode and
    # verify steps of a batch) at every request level the slots allow.
    probes = [(partial(cost.set, 1, n), partial(target, 1, n))
              for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= top]  # fmt: skip
    levels = sorted({lv for lv in (4, 16, policy.slots) if lv in cost.levels[1:]})  # others interpolate
    probes += [(partial(cost.set, R, R * w), partial(target, R, w))
               for R in levels for w in (1, 2, 4, 8) if R * w <= min(top, 256)]  # fmt: skip
    if policy.bundle is not None:
        k, H = policy.bundle.drafter.block_size, policy.model.config.hidden_size
        for R in sorted({1, min(4, policy.slots), min(16, policy.slots)}):
            block = policy.model.embed(torch.zeros(R, k, dtype=torch.long))
            args = (torch.arange(R), torch.full((R,), 16), block)
            probes.append(
                (
                    partial(policy.costs.drafter_block.set, R),
                    partial(policy.drafter.dslots.draft_hidden, *args),
                )
            )
        for n in (1, 2, 4, 8, 16, 64):
            x = torch.zeros(n, H, dtype=policy.model.dtype)
            probes.append((partial(policy.costs.drafter_lm.set, n), partial(policy.drafter.logits, x)))
        # The context projection of committed rows (a request's first draft after its prompt).
        d = policy.bundle.drafter
        for n in (16, 128, 1024):
            feats = torch.zeros(1, n, d.fc.in_features, dtype=d.fc.weight.dtype)
            args = (feats, torch.arange(n)[None])
            probes.append((partial(policy.costs.drafter_context.set, n), partial(d.context_kv, *args)))
    best = [float("inf")] * len(probes)
    for _ in range(repeats):
        for j, (_, fn) in enumerate(probes):
            t0 = clock()
            fn()
            best[j] = min(best[j], clock() - t0)
    for (record, _), seconds in zip(probes, best, strict=True):
        record(seconds)
    costs = policy.costs
    for curve in (costs.target, costs.drafter_block, costs.drafter_lm, costs.drafter_context):
        curve.make_monotone()
