"""The policy's rule for a batch without a queue: it decodes in lockstep until its longest request
ends, so only a step saved for the longest requests is worth a draft."""

from __future__ import annotations

from collections.abc import Sequence

from adaflash.serving.costs import MARGIN, Candidate, Option, StepCosts, lockstep_gain, plan_seconds
from adaflash.serving.request import Request

NONE = Option("none", 0, 0.0)


def critical(reqs: Sequence[Request], chosen: list[Option]) -> list[Option]:
    """With no request waiting, a draft for a shorter request, or for only some of the longest,
    saves no step and makes every step dearer (measured: C = 8 one-wave cells lost 12% to AR while
    the per-step rate gained 4%). So only the longest requests (within 2 tokens of the most
    remaining) draft, and only when the plan drafts for every one of them; otherwise the step
    runs plain. Exploration (after this) still samples the drafter now and then."""
    left = [r.params.max_tokens - len(r.output_ids) for r in reqs]
    longest = max(left)
    is_critical = [n >= longest - 2 for n in left]
    if all(o.proposer != "none" for o, c in zip(chosen, is_critical, strict=True) if c):
        return [o if c else NONE for o, c in zip(chosen, is_critical, strict=True)]
    return [NONE] * len(reqs)


def lockstep(
    costs: StepCosts,
    penalty: float,
    cands: Sequence[Candidate],
    chosen: list[Option],
    base_rows: int,
    fixed: int,
    requests: int,
) -> list[Option]:
    """A lockstep plan (`critical`) advances the batch by 1 + E[min accepted] steps, not by its
    mean: keep it only if that beats plain decoding's step rate by `MARGIN`."""
    curves = [c.survival(o.proposer)[: o.drafts]
              for c, o in zip(cands, chosen, strict=True) if o.proposer != "none"]  # fmt: skip
    if not curves:
        return chosen
    none = [NONE] * len(chosen)
    plain = plan_seconds(costs, none, base_rows, fixed, penalty, requests)
    sec = plan_seconds(costs, chosen, base_rows, fixed, penalty, requests)
    return chosen if (1 + lockstep_gain(curves)) * plain > (1 + MARGIN) * sec else none
