"""The policy's rule for a batch without a queue: it decodes in lockstep until its longest request
ends, so only a step saved for the longest requests is worth a draft."""

from __future__ import annotations

from collections.abc import Sequence

from adaflash.serving.costs import MARGIN, Candidate, Option, StepCosts, lockstep_gain, plan_seconds
from adaflash.serving.request import Request

NONE = Option("none", 0, 0.0)


def longest(reqs: Sequence[Request]) -> list[bool]:
    """The requests within 2 tokens of the most remaining: the ones the batch waits for."""
    left = [r.params.max_tokens - len(r.output_ids) for r in reqs]
    most = max(left)
    return [n >= most - 2 for n in left]


def critical(reqs: Sequence[Request], chosen: list[Option]) -> list[Option]:
    """With no request waiting, a draft for a shorter request, or for only some of the longest,
    saves no step and makes every step dearer (measured: C = 8 one-wave cells lost 12% to AR while
    the per-step rate gained 4%). So only the longest requests draft, and only when the plan
    drafts for every one of them; otherwise the step runs plain. Exploration (after this) still
    samples the drafter now and then."""
    is_critical = longest(reqs)
    if all(o.proposer != "none" for o, c in zip(chosen, is_critical, strict=True) if c):
        return [o if c else NONE for o, c in zip(chosen, is_critical, strict=True)]
    return [NONE] * len(reqs)


def confident(reqs: Sequence[Request], cands: Sequence[Candidate], min_prob: float) -> list[Option] | None:
    """A lockstep plan of model-free drafts alone: each longest request verifies the drafts its
    proposal estimates at ≥ `min_prob` to be accepted (a suffix draft's own estimate,
    `Draft.probs`: how far the matching occurrences agree; prompt lookup's measured survival),
    all cut to the shortest such run, since the batch advances by its slowest request. None when
    a longest request has no such draft. The rate objective prefers longer drafts, whose expected
    minimum over eight requests is small; a few sure ones can save a whole step. `lockstep` then
    values the plan on the policy's calibrated survival, like any other."""
    runs: dict[int, tuple[str, int]] = {}
    for j, (r, c, is_critical) in enumerate(zip(reqs, cands, longest(reqs), strict=True)):
        if not is_critical:
            continue
        best = ("none", 0)
        for name, surv, limit in c.model_free():
            own = name == "suffix" and len(r.suffix_probs) >= limit
            sure = r.suffix_probs[:limit] if own else surv[:limit]
            m = next((i for i, s in enumerate(sure) if s < min_prob), len(sure))
            if m > best[1]:
                best = (name, m)
        if not best[1]:
            return None
        runs[j] = best
    m = min(n for _, n in runs.values())
    return [Option(runs[j][0], m, sum(cands[j].survival(runs[j][0])[:m])) if j in runs else NONE
            for j in range(len(reqs))]  # fmt: skip


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
