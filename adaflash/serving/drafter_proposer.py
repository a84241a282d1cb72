"""The DFlash drafter as a proposer: its context cache, the block forward with the length head's
â, and the drafter's LM head over only the kept positions (the LM head is most of a drafter
round's cost, so a row the round will not verify never goes through it).

Two phases per step, because `adaflash-cost` chooses a request's length between them (with â
known, the block forward is paid and only verify rows and LM-head rows still cost):
`forward(requests)` → `Block`, then `tokens(block, lengths)` → `Drafted`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.length_head import verify_lengths
from adaflash.models.packed import fused_linear
from adaflash.models.transformer import TargetModel
from adaflash.serving import verifier
from adaflash.serving.proposer import ProposerConfig, clock
from adaflash.serving.request import Request
from adaflash.serving.runner import DrafterSlots, PackedBatch, PackedRunner, Segment


@dataclass
class Block:
    """One step's drafter block forward over `reqs`: hidden states, and â for the requests at
    `heads` (indexes into `reqs`) whose method reads the length head."""

    reqs: list[Request]
    hidden: torch.Tensor  # [R, k, H]
    heads: list[int]
    a_hat: torch.Tensor | None  # [len(heads)]


@dataclass
class Drafted:
    """The drafts of a block, per request of the block, and what the LM head cost."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]  # q per draft (sampling requests), None for greedy ones
    lm_rows: int
    lm_seconds: float


class DrafterProposer:
    name = "drafter"

    def __init__(self, model: TargetModel, config: ProposerConfig, slots: int, capacity: int) -> None:
        self.model, self.config = model, config
        self.slots, self.capacity = slots, capacity
        self.bundle: DrafterBundle | None = None
        self.version: str | None = None
        self.dslots: DrafterSlots | None = None
        self.vocab: torch.Tensor | None = None
        self._head: torch.nn.Linear | None = None

    @property
    def block_size(self) -> int:
        return self.bundle.drafter.block_size if self.bundle else 1

    def install(self, bundle: DrafterBundle | None, version: str | None) -> None:
        self.bundle = bundle
        self.version = version if bundle is not None else None
        self.dslots = DrafterSlots(bundle.drafter, self.slots, self.capacity) if bundle else None
        # Draft logits over the drafter's own vocabulary only: the LM head is most of a drafter
        # round's cost (49k rows for SmolLM2, ~7k in the shipped drafter's vocabulary).
        vocab = bundle.draft_vocab if bundle is not None else None
        self.vocab = vocab
        self._head = None
        if vocab is not None:
            rows = self.model.lm_head.weight[vocab]
            self._head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
            self._head.weight = torch.nn.Parameter(rows.contiguous(), requires_grad=False)

    def extend(self, features: torch.Tensor, slot_rows: torch.Tensor, positions: torch.Tensor,
               shared: bool = False) -> None:  # fmt: skip
        if self.dslots is not None:
            self.dslots.extend(features, slot_rows, positions, shared)

    def admit(self, req: Request) -> None:
        """A new occupant of `req.slot`: only the cost policy's requests may lose their drafter
        context past the queue's bound (they then decode with lookups or plainly; `dflash` and
        `adaflash` draft every round)."""
        if self.dslots is not None:
            self.dslots.set_droppable(req.slot, req.method == "adaflash-cost")

    def can_draft(self, req: Request) -> bool:
        """Whether the request's drafter context is whole (not dropped past the bound)."""
        return self.dslots is not None and req.slot not in self.dslots.lost

    def pending_rows(self, req: Request) -> int:
        """Committed rows the request's next drafter round projects before its block."""
        return self.dslots.pending(req.slot) if self.dslots is not None else 0

    def rebuild(self, live: list[Request], runner: PackedRunner) -> None:
        """A new drafter's context cache for in-flight requests, from their committed tokens'
        target features (the target K/V rewritten on the way are the same values)."""
        if not live or self.bundle is None:
            return
        committed = [r.tokens[: r.kv_len] for r in live]
        batch = PackedBatch.build([Segment(r.slot, 0, t) for r, t in zip(live, committed, strict=True)])
        _, features = runner.forward(batch, tuple(self.bundle.config.target_layer_ids))
        self.extend(features, batch.slot_rows, batch.positions)

    # --- one step's drafts -----------------------------------------------------------------------

    def project(self, reqs: list[Request]) -> None:
        """Project the requests' queued context rows into the drafter's cache (what `forward`
        would do first): a one-off per committed row, timed apart from the block's own cost."""
        self.dslots.flush([r.slot for r in reqs])

    def forward(self, reqs: list[Request]) -> Block:
        """The block forward (anchor + mask tokens over each request's context) and â for every
        request whose method reads the length head (all of them with `shadow_a_hat`)."""
        d = self.bundle.drafter
        k = d.block_size
        block = torch.full((len(reqs), k), d.config.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
        slots, lengths = torch.tensor([r.slot for r in reqs]), torch.tensor([r.kv_len for r in reqs])
        hidden = self.dslots.draft_hidden(slots, lengths, self.model.embed(block))
        heads = [j for j, r in enumerate(reqs) if r.method != "dflash"]
        if self.config.shadow_a_hat and self.bundle.length_head is not None:
            heads = list(range(len(reqs)))
        a_hat = self.bundle.length_head(hidden[heads]) if heads else None
        return Block(reqs, hidden, heads, a_hat)

    def lengths(self, block: Block) -> torch.Tensor:
        """k̂ per request of the block: the full block, or the head's ⌊γ·â·k⌋ for `adaflash` (a
        k̂ of 1 then skips the next `probe_every` − 1 rounds' drafts: the probe policy)."""
        k = self.block_size
        kh = torch.full((len(block.reqs),), k, dtype=torch.long)
        if block.a_hat is None:
            return kh
        khat_all = verify_lengths(block.a_hat, k, self.config.gamma)
        for pos, j in enumerate(block.heads):
            r = block.reqs[j]
            if r.method == "adaflash":
                kh[j] = khat_all[pos]
                if kh[j] == 1:
                    r.skip_drafts = self.config.probe_every - 1
        return kh

    def tokens(self, block: Block, kh: torch.Tensor) -> Drafted:
        """k̂ − 1 drafts per request (never past its max_tokens): greedy, or sampled from q filtered
        exactly like the target's p will be (lossless top-k / top-p)."""
        reqs, k = block.reqs, self.block_size
        remaining = torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs])
        kh = torch.minimum(kh, remaining)
        keep = torch.arange(1, k)[None, :] < kh[:, None]  # [R, k-1]
        t0 = clock()
        d_logits = self.logits(block.hidden[:, 1:][keep])  # only kept rows: the LM head dominates
        lm_seconds = clock() - t0
        owner = keep.nonzero()[:, 0]
        greedy_tok = d_logits.argmax(-1)
        if self.vocab is not None:
            greedy_tok = self.vocab[greedy_tok]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for j, r in enumerate(reqs):
            rows = (owner == j).nonzero().squeeze(1)
            if r.params.temperature == 0:
                tokens[j] = greedy_tok[rows].tolist()
            elif rows.numel():
                try:
                    p = verifier.dist(self.full(d_logits[rows]), [r] * rows.numel())
                    tokens[j] = torch.multinomial(p, 1, generator=r.generator).squeeze(1).tolist()
                    probs[j] = p
                except verifier.SAMPLING_ERRORS as exc:
                    r.fail(f"drafting failed: {exc}")
        return Drafted(tokens, probs, int(keep.sum()), lm_seconds)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head is None:
            return self.model.logits(hidden)
        return fused_linear(self, "draft_head", hidden, self._head)[0]  # prepacked, like the target's

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits on the whole vocabulary (−inf outside the drafter's): q for sampling."""
        if self.vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.model.config.vocab_size), float("-inf"))
        full[:, self.vocab] = logits
        return full
