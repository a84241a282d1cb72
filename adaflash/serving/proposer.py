"""Proposals for one step: drafter context, the block forward, the length head, kept rows, n-gram
lookup and the cost-aware policy (SGLang's speculative worker, minus the verification).

Per decoding request, by method:
- `ar`: nothing (k̂ = 1);
- `ngram`: prompt lookup, as many drafts as the block allows; `suffix`: suffix decoding (the
  request's own text and its tenant's governed responses), as many as its match allows;
- `dflash`: the drafter's full block; `adaflash`: the length head's k̂ = ⌊γ·â·k⌋ (plus the probe
  policy when `probe_every` > 1);
- `adaflash-cost`: `costs.choose` picks drafter, n-gram, suffix or none and the length from the
  measured step costs and acceptance; after the drafter forward, â refines that request's
  length (the block forward is then paid; only verify rows and drafter LM-head rows still cost).
Only the kept positions of a drafted block go through the drafter's LM head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from adaflash import kernels
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.length_head import verify_lengths
from adaflash.models.packed import fused_linear
from adaflash.models.transformer import TargetModel
from adaflash.serving import verifier
from adaflash.serving.costs import (
    MARGIN,
    AcceptanceStats,
    Candidate,
    CostCurve,
    Option,
    SpeculationGuard,
    StepCosts,
    TargetCost,
    _pick,
    choose,
    lockstep_gain,
    plan_seconds,
    rescaled,
    scaled,
)
from adaflash.serving.lookup import LookupProposer, PromptLookupProposer, SuffixProposer
from adaflash.serving.request import DRAFTER_METHODS, LOOKUP_METHODS, Request
from adaflash.serving.runner import DrafterSlots, PackedBatch, PackedRunner, Segment
from adaflash.serving.suffix_cache import SuffixCache
from adaflash.serving.verifier import Plan

NGRAM_BLOCK = 8  # anchor + up to 7 looked-up drafts when no drafter fixes the block size
# The policy's clock: CPU seconds of this process. On a machine shared with other jobs, wall time
# also counts the time the scheduler gave to them, which says nothing about what a draft costs.
clock = time.process_time
EXPLORE_EVERY = 32  # steps without a policy drafter forward before one is forced (fresh â)
# Per load bucket, each exploration that did not win the drafter back doubles the gap to the
# next one, up to this: at a load where drafting never pays (C >= 8 on this CPU), exploring every
# 32 steps was a steady ~1.5% tax; a plan that chooses to draft again resets the gap.
EXPLORE_MAX_GAP = 512
IDLE_RECHECK = 8  # after this many no-draft plans in a row, only every 8th step is priced
MEMORY = 0.3  # weight of the newest round in a request's acceptance memory


@dataclass
class ProposerConfig:
    gamma: float = 1.0
    shadow_a_hat: bool = False
    probe_every: int = 1


class Proposer:
    def __init__(
        self,
        model: TargetModel,
        config: ProposerConfig,
        slots: int,
        capacity: int,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        self.model, self.config = model, config
        # The model-free proposers, by name (each is also a method of its own).
        self.lookups: dict[str, LookupProposer] = {
            "ngram": PromptLookupProposer(),
            "suffix": SuffixProposer(suffix_cache),
        }
        self.slots, self.capacity = slots, capacity
        self.bundle: DrafterBundle | None = None
        self.version: str | None = None
        self.dslots: DrafterSlots | None = None
        self.costs = StepCosts(TargetCost(2048, slots), CostCurve(64), CostCurve(512))
        self._requests = 1  # this step's decoding requests (the target cost's second axis)
        self.stats: dict[str, AcceptanceStats] = {}
        self.mean_a_hat: float | None = None  # running mean of â over drafted rounds (head level)
        self.guard = SpeculationGuard()
        self._penalty = 1.0
        self.steps_since_draft = 0
        self._explore_turn = 0
        self._explore_gap: dict[int, int] = {}  # per load bucket: steps between forced explorations
        self._idle: dict[int, int] = {}  # per load bucket: plans in a row that chose no draft
        self._draft_seconds = 0.0  # drafter time of the current step (block + LM head)
        # This step's model-free proposals, per proposer and request index (scored in observe).
        self._proposed: dict[str, dict[int, list[int]]] = {}
        self._suffix_calib = (0.0, 0.0)  # decayed (accepted, estimated) suffix drafts
        self._methods: list[str] = []  # this step's decoding requests' methods
        self._reset_stats()

    # --- drafter (install / context) -----------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.bundle.drafter.block_size if self.bundle else 1

    @property
    def lookup_block(self) -> int:
        """Positions an n-gram round verifies at most (anchor included)."""
        return self.block_size if self.bundle is not None else NGRAM_BLOCK

    def stamp(self, req: Request) -> None:
        """Record on `req` what serves it: the drafter version and the block its rounds verify."""
        if req.method in DRAFTER_METHODS:
            req.drafter_version, req.block_size = self.version, self.block_size
        elif req.method in LOOKUP_METHODS:  # no drafter: lookups verify up to the proposer's block
            req.drafter_version, req.block_size = None, self.lookup_block

    def install(self, bundle: DrafterBundle | None, version: str | None) -> None:
        self.bundle = bundle
        self.version = version if bundle is not None else None
        self.dslots = DrafterSlots(bundle.drafter, self.slots, self.capacity) if bundle else None
        # Draft logits over the drafter's own vocabulary only: the LM head is most of a drafter
        # round's cost (49k rows for SmolLM2, ~7k in the shipped drafter's vocabulary).
        vocab = bundle.draft_vocab if bundle is not None else None
        self.vocab = vocab
        self._head: torch.nn.Linear | None = None
        if vocab is not None:
            rows = self.model.lm_head.weight[vocab]
            self._head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
            self._head.weight = torch.nn.Parameter(rows.contiguous(), requires_grad=False)
        self._reset_stats()

    def _reset_stats(self) -> None:
        k = self.lookup_block
        self.mean_a_hat = None
        # Optimistic n-gram prior: lookup costs no forward, so it gets tried and measured early.
        self.stats = {"drafter": AcceptanceStats(k - 1)}
        for name in self.lookups:
            self.stats[name] = AcceptanceStats(k - 1, prior=0.6, prior_weight=4)

    def extend(self, features: torch.Tensor, slot_rows: torch.Tensor, positions: torch.Tensor) -> None:
        if self.dslots is not None:
            self.dslots.extend(features, slot_rows, positions)

    def rebuild(self, live: list[Request], runner: PackedRunner) -> None:
        """A new drafter's context cache for in-flight requests, from their committed tokens'
        target features (the target K/V rewritten on the way are the same values)."""
        if not live or self.bundle is None:
            return
        committed = [r.tokens[: r.kv_len] for r in live]
        batch = PackedBatch.build([Segment(r.slot, 0, t) for r, t in zip(live, committed, strict=True)])
        _, features = runner.forward(batch, tuple(self.bundle.config.target_layer_ids))
        self.extend(features, batch.slot_rows, batch.positions)

    # --- one step's proposals ------------------------------------------------------------------

    def plan(self, decoding: list[Request], base_rows: int, waiting: bool = True) -> Plan:
        """Proposals for every decoding request. `base_rows`: the step's prefill rows. `waiting`:
        requests queue for a slot (then a token committed early is worth its rate: it frees the
        slot sooner); without a queue the policy drafts for the batch's longest requests together
        or not at all (`_critical`)."""
        n = len(decoding)
        k = self.lookup_block
        opts: list[Option] = [Option("none", 0, 0.0)] * n
        proposed: dict[str, dict[int, list[int]]] = {name: {} for name in self.lookups}
        fixed = []  # drafter requests of fixed-policy methods
        policy = [i for i, r in enumerate(decoding) if r.method == "adaflash-cost" and self.bundle]
        for i, r in enumerate(decoding):
            if r.method in LOOKUP_METHODS:
                drafts = proposed[r.method][i] = self._lookup(r.method, r, k)
                opts[i] = Option(r.method, len(drafts), 0.0)
            elif r.method in ("dflash", "adaflash"):
                if r.skip_drafts > 0:
                    r.skip_drafts -= 1  # an AR round: k̂ = 1, no draft (probe policy)
                else:
                    fixed.append(i)
        rate = 0.0
        bucket = SpeculationGuard.bucket(n)
        idle = self._idle.get(bucket, 0)
        gap = self._explore_gap.get(bucket, EXPLORE_EVERY)
        if policy and idle >= IDLE_RECHECK and idle % IDLE_RECHECK and self.steps_since_draft + 1 < gap:
            # Priced out at this load: the last plans chose no draft, so most steps skip pricing
            # (its Python costs a few % of a batch step) and run as AR; every IDLE_RECHECK-th step
            # prices again, and exploration still comes every `gap` steps.
            self._idle[bucket] = idle + 1
            self.steps_since_draft += 1
        elif policy:
            # Looked up only when the step is priced: an idle step (above) skips the per-request
            # Python; the index catches up with every token the next time it is asked.
            for name, found in proposed.items():
                found.update({i: self._lookup(name, decoding[i], k) for i in policy})
            cands = [self._candidate(decoding[i], {m: p[i] for m, p in proposed.items()}, k) for i in policy]
            base = base_rows + n + len(fixed) * (k - 1)
            base += sum(o.drafts for r, o in zip(decoding, opts, strict=True) if r.method in LOOKUP_METHODS)
            self._penalty = self.guard.penalty(n)
            self._requests = n
            chosen, rate = choose(
                cands, self.costs, base, float(n), len(fixed), penalty=self._penalty, requests=n
            )
            if not waiting and len(policy) > 1:
                chosen = self._critical([decoding[i] for i in policy], chosen)
                chosen = self._lockstep(cands, chosen, base, len(fixed), n)
            priced_out = all(o.proposer == "none" for o in chosen)
            self._idle[bucket] = idle + 1 if priced_out else 0
            if any(o.proposer == "drafter" for o in chosen):
                self._explore_gap[bucket] = EXPLORE_EVERY  # the drafter pays here again
            self.steps_since_draft += 1
            if self.guard.want_plain_step(n) and len(policy) == n and not base_rows:
                chosen = [Option("none", 0, 0.0)] * len(policy)  # measure what plain steps deliver
            elif self.steps_since_draft >= gap:  # keep â and the drafter's stats fresh
                # One request drafts its full room, in turn: a fresh â and acceptance sample for
                # the price of one block, not a batch of full-block verifies.
                able = [j for j, c in enumerate(cands) if c.drafter_limit]
                if able:
                    j = able[self._explore_turn % len(able)]
                    self._explore_turn += 1
                    chosen[j] = Option("drafter", cands[j].drafter_limit, 0.0)
                    self._explore_gap[bucket] = min(2 * gap, EXPLORE_MAX_GAP)
            for i, o in zip(policy, chosen, strict=True):
                opts[i] = o
            if any(o.proposer == "drafter" for o in chosen):
                self.steps_since_draft = 0
        drafted = [i for i in range(n) if i in fixed or opts[i].proposer == "drafter"]
        drafts_per: list[list[int]] = [self._chosen(proposed, opts[i], i) for i in range(n)]
        probs_per: list[torch.Tensor | None] = [None] * n
        a_hat: list[float | None] = [None] * n
        if drafted:
            t0 = clock()
            self._draft(decoding, drafted, opts, proposed, rate, drafts_per, probs_per, a_hat)
            self._draft_seconds = clock() - t0
        V = self.model.config.vocab_size
        for i, r in enumerate(decoding):
            if drafts_per[i] and r.params.temperature > 0 and probs_per[i] is None:
                # A lookup draft's q is the point mass on it: speculative sampling accepts x with
                # probability p(x) and resamples the residual — still lossless.
                q = torch.zeros(len(drafts_per[i]), V, dtype=self.model.dtype)
                q[torch.arange(len(drafts_per[i])), torch.tensor(drafts_per[i])] = 1.0
                probs_per[i] = q
        self._proposed = proposed
        self._methods = [r.method for r in decoding]
        proposer = [
            opts[i].proposer if opts[i].proposer in self.lookups else "drafter" if i in drafted else "none"
            for i in range(n)
        ]
        khat = [len(ds) + 1 for ds in drafts_per]
        verify_tokens = [[r.output_ids[-1], *drafts_per[i]] for i, r in enumerate(decoding)]
        drafts = torch.tensor([t for ds in drafts_per for t in ds], dtype=torch.long)
        d_probs = None
        if any(p is not None for p in probs_per):
            dtype = next(p.dtype for p in probs_per if p is not None)
            d_probs = torch.cat([p if p is not None else torch.zeros(len(ds), V, dtype=dtype)
                                 for p, ds in zip(probs_per, drafts_per, strict=True)])  # fmt: skip
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = torch.tensor(khat).cumsum(0)
        return Plan(verify_tokens, khat, a_hat, proposer, drafts, d_probs, cu)

    @staticmethod
    def _critical(reqs: list[Request], chosen: list[Option]) -> list[Option]:
        """With no request waiting, the batch decodes in lockstep until its longest request ends:
        a draft for a shorter request, or for only some of the longest, saves no step and makes
        every step dearer (measured: C = 8 one-wave cells lost 12% to AR while the per-step rate
        gained 4%). So only the longest requests (within 2 tokens of the most remaining) draft,
        and only when the plan drafts for every one of them; otherwise the step runs plain.
        Exploration (after this) still samples the drafter now and then."""
        left = [r.params.max_tokens - len(r.output_ids) for r in reqs]
        longest = max(left)
        critical = [n >= longest - 2 for n in left]
        if all(o.proposer != "none" for o, c in zip(chosen, critical, strict=True) if c):
            return [o if c else Option("none", 0, 0.0) for o, c in zip(chosen, critical, strict=True)]
        return [Option("none", 0, 0.0)] * len(reqs)

    def _lockstep(
        self, cands: list[Candidate], chosen: list[Option], base_rows: int, fixed: int, requests: int
    ) -> list[Option]:
        """A lockstep plan (`_critical`) advances the batch by 1 + E[min accepted] steps, not by
        its mean: keep it only if that beats plain decoding's step rate by `MARGIN`."""
        curves = [c.survival(o.proposer)[: o.drafts]
                  for c, o in zip(cands, chosen, strict=True) if o.proposer != "none"]  # fmt: skip
        if not curves:
            return chosen
        none = [Option("none", 0, 0.0)] * len(chosen)
        plain = plan_seconds(self.costs, none, base_rows, fixed, self._penalty, requests)
        sec = plan_seconds(self.costs, chosen, base_rows, fixed, self._penalty, requests)
        return chosen if (1 + lockstep_gain(curves)) * plain > (1 + MARGIN) * sec else none

    @staticmethod
    def _room(r: Request, k: int) -> int:
        """Drafts a round of this request may verify: the block's k − 1, less near max_tokens."""
        return max(0, min(k - 1, r.params.max_tokens - len(r.output_ids) - 1))

    def _lookup(self, name: str, r: Request, k: int) -> list[int]:
        """The request's drafts from one model-free proposer: as many as the block and its
        remaining tokens allow (fewer where the proposer is unsure)."""
        room = self._room(r, k)
        return self.lookups[name].propose(r, room) if room else []

    @staticmethod
    def _chosen(proposed: dict[str, dict[int, list[int]]], o: Option, i: int) -> list[int]:
        """The drafts a model-free option verifies (the drafter's are filled in by `_draft`)."""
        return proposed[o.proposer][i][: o.drafts] if o.proposer in proposed else []

    def _lookup_survival(self, r: Request, name: str, drafts: list[int]) -> list[float]:
        """A model-free proposal's expected acceptance: the proposer's measured conditionals, the
        first position set to this request's own hit rate with it. A suffix draft carries its own
        estimate (how far the matching occurrences agree): that, times the measured ratio of
        accepted to estimated suffix drafts (`suffix_calibration`), prices it instead — a
        30-token match that 5 earlier answers continue alike is not a coin flip."""
        if not drafts:
            return []
        if name == "suffix" and len(r.suffix_probs) >= len(drafts):
            c = self.suffix_calibration
            return [min(1.0, p * c) for p in r.suffix_probs[: len(drafts)]]
        stats = self.stats[name]
        first = r.accept_ema.get(name, stats.conditional()[0])
        return scaled(stats.survival(), first)[: len(drafts)]

    def _candidate(self, r: Request, proposed: dict[str, list[int]], k: int) -> Candidate:
        room = self._room(r, k)
        ngram = proposed.get("ngram", [])
        dr = self.stats["drafter"].survival()
        mean = self.mean_a_hat or 1.0
        a = r.accept_ema.get("a_hat", mean)
        others = {name: (self._lookup_survival(r, name, d), len(d))
                  for name, d in proposed.items() if name != "ngram" and d}  # fmt: skip
        return Candidate(
            self._lookup_survival(r, "ngram", ngram),
            len(ngram),
            rescaled(dr, a / max(mean, 1e-3))[:room] if room else [],
            room,
            others,
        )

    def _draft(self, decoding, drafted, opts, proposed, rate, drafts_per, probs_per, a_hat) -> None:
        d = self.bundle.drafter
        k = d.block_size
        reqs = [decoding[i] for i in drafted]
        block = torch.full((len(reqs), k), d.config.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
        t0 = clock()
        slots, lengths = torch.tensor([r.slot for r in reqs]), torch.tensor([r.kv_len for r in reqs])
        hidden = self.dslots.draft_hidden(slots, lengths, self.model.embed(block))
        kh = torch.full((len(reqs),), k, dtype=torch.long)
        heads = [j for j, r in enumerate(reqs) if r.method != "dflash"]
        if self.config.shadow_a_hat and self.bundle.length_head is not None:
            heads = list(range(len(reqs)))
        ah = self.bundle.length_head(hidden[heads]) if heads else None
        self.costs.drafter_block.observe(len(reqs), clock() - t0)  # block forward + length head
        if ah is not None:
            khat_all = verify_lengths(ah, k, self.config.gamma)
            for pos, j in enumerate(heads):
                r, i, a = reqs[j], drafted[j], float(ah[pos])
                a_hat[i] = a
                if r.method == "adaflash":
                    kh[j] = khat_all[pos]
                    if kh[j] == 1:
                        r.skip_drafts = self.config.probe_every - 1
                elif r.method == "adaflash-cost":
                    kh[j] = self._refine(r, i, a, opts, proposed, rate) + 1
        # A round yields at most k̂ tokens: never verify past max_tokens.
        remaining = torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs])
        kh = torch.minimum(kh, remaining)
        keep = torch.arange(1, k)[None, :] < kh[:, None]  # [R, k-1]
        t0 = clock()
        d_logits = self._logits(hidden[:, 1:][keep])  # only kept rows: the LM head dominates
        self.costs.drafter_lm.observe(int(keep.sum()), clock() - t0)
        owner = keep.nonzero()[:, 0]
        greedy_tok = d_logits.argmax(-1)
        if self.vocab is not None:
            greedy_tok = self.vocab[greedy_tok]
        for j, r in enumerate(reqs):
            i = drafted[j]
            if opts[i].proposer in self.lookups:  # the refinement preferred a lookup draft after all
                drafts_per[i] = self._chosen(proposed, opts[i], i)
                continue
            rows = (owner == j).nonzero().squeeze(1)
            if r.params.temperature == 0:
                drafts_per[i] = greedy_tok[rows].tolist()
            elif rows.numel():
                try:  # q is filtered exactly like p will be (lossless top-k / top-p)
                    p = verifier.dist(self._full(d_logits[rows]), [r] * rows.numel())
                    drafts_per[i] = torch.multinomial(p, 1, generator=r.generator).squeeze(1).tolist()
                    probs_per[i] = p
                except verifier.SAMPLING_ERRORS as exc:
                    r.fail(f"drafting failed: {exc}")
                    drafts_per[i] = []

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head is None:
            return self.model.logits(hidden)
        return fused_linear(self, "draft_head", hidden, self._head)[0]  # prepacked, like the target's

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits on the whole vocabulary (−inf outside the drafter's): q for sampling."""
        if self.vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.model.config.vocab_size), float("-inf"))
        full[:, self.vocab] = logits
        return full

    def _refine(self, r: Request, i: int, a: float, opts, proposed, rate: float) -> int:
        """With â known, the best of drafter / lookups / none for this request (block forward paid)."""
        k = self.block_size
        r.accept_ema["a_hat"] = (1 - MEMORY) * r.accept_ema.get("a_hat", a) + MEMORY * a
        self.mean_a_hat = a if self.mean_a_hat is None else 0.98 * self.mean_a_hat + 0.02 * a
        cand = self._candidate(r, {m: p.get(i, []) for m, p in proposed.items()}, k)
        ratio = a / max(self.mean_a_hat, 1e-3)
        cand.drafter_survival = rescaled(self.stats["drafter"].survival(), ratio)[: cand.drafter_limit]
        rows = max(sum(o.drafts for o in opts), 1)
        step = self.costs.target(rows + 1, self._requests) - self.costs.target(rows, self._requests)
        row_price = self._penalty * step
        lm_price = self._penalty * self.costs.drafter_lm(rows) / rows
        o = _pick(cand, rate, max(row_price, 0.0), lm_price, 0.0)
        opts[i] = o
        return o.drafts if o.proposer == "drafter" else 0

    # --- feedback from verification ------------------------------------------------------------

    @property
    def suffix_calibration(self) -> float:
        """Accepted / estimated suffix drafts (decayed sums, a prior of 8 drafts at 0.8)."""
        acc, est = self._suffix_calib
        return max(0.2, min(1.5, (acc + 6.4) / (est + 8.0)))

    def _calibrate_suffix(self, probs: list[float], tried: int, hits: int) -> None:
        acc, est = self._suffix_calib
        self._suffix_calib = (0.99 * acc + hits, 0.99 * est + sum(probs[:tried]))

    def observe(self, decoding: list[Request], plan: Plan, accepted: list[int], nxt: list[int]) -> None:
        """Acceptance from this step's verification. A policy request's lookup proposals are
        also scored when they were not the one verified: their drafts are compared with the
        tokens the step committed (known up to accepted + 1 of them), which measures them for
        free."""
        doff = kernels.draft_offsets(plan.cu)
        for i, r in enumerate(decoding):
            p, drafted = plan.proposer[i], plan.khat[i] - 1
            if p in self.stats and drafted > 0:
                self.stats[p].observe(drafted, accepted[i])
            for name, found in self._proposed.items():
                proposal = found.get(i)
                if p == name:
                    hits = accepted[i]
                    if name == "suffix":
                        self._calibrate_suffix(r.suffix_probs, drafted, hits)
                elif proposal and r.method == "adaflash-cost":
                    lo = int(doff[i])
                    new = plan.drafts[lo : lo + accepted[i]].tolist() + [nxt[i]]
                    tried = min(len(proposal), len(new))
                    hits = next((j for j in range(tried) if proposal[j] != new[j]), tried)
                    self.stats[name].observe(tried, hits)
                    if name == "suffix" and hits < tried:  # its full acceptance is known: hits
                        self._calibrate_suffix(r.suffix_probs, len(proposal), hits)
                else:
                    continue
                hit = float(hits > 0)
                r.accept_ema[name] = (1 - MEMORY) * r.accept_ema.get(name, hit) + MEMORY * hit
        self._proposed = {}

    def observe_step(
        self,
        rows: int,
        target_seconds: float,
        step_seconds: float,
        plan: Plan,
        emitted: int,
        prefill: bool,
        requests: int = 1,
    ) -> None:
        """The step's measured target forward (+ logits), everything else it spent, and (for the
        guard) what a decode-only step delivered, with or without drafts."""
        self.costs.target.observe(rows, requests, target_seconds)
        if plan.khat and not prefill and all(r == "adaflash-cost" for r in self._methods):
            speculated = any(p != "none" for p in plan.proposer)
            self.guard.observe(len(plan.khat), emitted, step_seconds, speculated)
        rest = max(step_seconds - target_seconds - self._draft_seconds, 0.0)
        self.costs.overhead = 0.9 * self.costs.overhead + 0.1 * rest
        self._draft_seconds = 0.0
