"""The proposers' shared shape: what a proposer is, its config, and how one step's proposals pack
into the verifier's `Plan` (SGLang's speculative worker, minus the verification; vLLM v1's one
class per proposer).

The proposers, one class each:
- `DrafterProposer` (`drafter_proposer.py`): the DFlash block forward, the length head's â, and
  the drafter's LM head over only the kept positions;
- `PromptLookupProposer` (`ngram`) and `SuffixProposer` (`suffix`), model-free (`lookup.py`);
- `CostPolicy` (`policy.py`) owns them, the measured costs and the acceptance, and chooses per
  request and round which proposer (or none) and how many tokens.

Per decoding request, by method:
- `ar`: nothing (k̂ = 1);
- `ngram`: prompt lookup, as many drafts as the block allows; `suffix`: suffix decoding (the
  request's own text and its tenant's governed responses), as many as its match allows;
- `dflash`: the drafter's full block; `adaflash`: the length head's k̂ = ⌊γ·â·k⌋ (plus the probe
  policy when `probe_every` > 1);
- `adaflash-cost`: `costs.choose` picks drafter, n-gram, suffix or none and the length from the
  measured step costs and acceptance; after the drafter forward, â refines that request's
  length (the block forward is then paid; only verify rows and drafter LM-head rows still cost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from adaflash.serving.costs import Option
from adaflash.serving.request import Request
from adaflash.serving.verifier import Plan

NGRAM_BLOCK = 8  # anchor + up to 7 looked-up drafts when no drafter fixes the block size
# The policy's clock: CPU seconds of this process. On a machine shared with other jobs, wall time
# also counts the time the scheduler gave to them, which says nothing about what a draft costs.
clock = time.process_time


@dataclass
class ProposerConfig:
    gamma: float = 1.0
    shadow_a_hat: bool = False
    probe_every: int = 1
    # > 0: with no request waiting, a step whose priced lockstep plan drafts nothing verifies the
    # longest requests' model-free drafts estimated at >= this (`lockstep.confident`). Off: 0.
    lockstep_min_prob: float = 0.0


class Proposer(Protocol):
    """A model-free proposer: at most `room` draft tokens to follow the request's text. The policy
    measures what each one's drafts deliver (it sees every verification), so a proposer keeps no
    acceptance of its own. The drafter is batched and two-phase (its length is chosen between
    the block forward and the LM head), so `DrafterProposer` has `forward` and `tokens` instead."""

    name: str

    def propose(self, req: Request, room: int) -> list[int]: ...


def room(r: Request, k: int) -> int:
    """Drafts a round of this request may verify: the block's k − 1, less near max_tokens."""
    return max(0, min(k - 1, r.params.max_tokens - len(r.output_ids) - 1))


def assemble(
    decoding: list[Request],
    drafts_per: list[list[int]],
    probs_per: list[torch.Tensor | None],
    a_hat: list[float | None],
    proposer: list[str],
    vocab_size: int,
    dtype: torch.dtype,
) -> Plan:
    """The step's proposals packed for the verifier. A sampling request's model-free draft gets
    q = the point mass on it: speculative sampling accepts x with probability p(x) and resamples
    the residual, still lossless."""
    n = len(decoding)
    for i, r in enumerate(decoding):
        if drafts_per[i] and r.params.temperature > 0 and probs_per[i] is None:
            q = torch.zeros(len(drafts_per[i]), vocab_size, dtype=dtype)
            q[torch.arange(len(drafts_per[i])), torch.tensor(drafts_per[i])] = 1.0
            probs_per[i] = q
    khat = [len(ds) + 1 for ds in drafts_per]
    verify_tokens = [[r.output_ids[-1], *drafts_per[i]] for i, r in enumerate(decoding)]
    drafts = torch.tensor([t for ds in drafts_per for t in ds], dtype=torch.long)
    d_probs = None
    if any(p is not None for p in probs_per):
        dt = next(p.dtype for p in probs_per if p is not None)
        d_probs = torch.cat([p if p is not None else torch.zeros(len(ds), vocab_size, dtype=dt)
                             for p, ds in zip(probs_per, drafts_per, strict=True)])  # fmt: skip
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.tensor(khat).cumsum(0)
    return Plan(verify_tokens, khat, a_hat, proposer, drafts, d_probs, cu)


@dataclass
class StepProposals:
    """One step's working plan, per decoding request (index i)."""

    opts: list[Option]
    proposed: dict[str, dict[int, list[int]]]  # model-free proposals, per proposer and request
    fixed: list[int]  # requests of fixed-policy drafter methods (`dflash`, `adaflash`)
    rate: float = 0.0  # the chosen plan's expected tokens/second (λ)
    drafts: list[list[int]] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    a_hat: list[float | None] = field(default_factory=list)
    explore: int | None = None  # the request forced to draft its full room this step (an acceptance sample)
