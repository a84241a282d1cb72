"""The cost policy: per step, every decoding request's proposal, and for `adaflash-cost` the
choice among the proposers (drafter / prompt lookup / suffix cache / none) and the length, from
their priced candidates (`costs.choose`: expected committed tokens per CPU-second of the step).

It owns the proposers (`DrafterProposer`, `PromptLookupProposer`, `SuffixProposer`), the measured
step costs, the acceptance per proposer and per request, and the guard that keeps speculation
from losing to plain decoding. The engine talks to it alone: `plan` before the target forward,
`observe` after verification, `observe_step` with the step's measured times.
"""

from __future__ import annotations

import torch

from adaflash import kernels
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.transformer import TargetModel
from adaflash.serving import lockstep
from adaflash.serving.acceptance import AcceptanceStats, Reliability
from adaflash.serving.costs import (
    Candidate,
    CostCurve,
    Option,
    SpeculationGuard,
    StepCosts,
    TargetCost,
    _pick,
    choose,
    rescaled,
    scaled,
)
from adaflash.serving.drafter_proposer import DrafterProposer
from adaflash.serving.lookup import PromptLookupProposer, SuffixProposer
from adaflash.serving.proposer import (
    NGRAM_BLOCK,
    Proposer,
    ProposerConfig,
    StepProposals,
    assemble,
    clock,
    room,
)
from adaflash.serving.request import DRAFTER_METHODS, LOOKUP_METHODS, Request
from adaflash.serving.runner import PackedRunner
from adaflash.serving.suffix_cache import SuffixCache
from adaflash.serving.verifier import Plan

EXPLORE_EVERY = 32  # steps without a policy drafter forward before one is forced (fresh â)
# Per load bucket, each exploration that did not win the drafter back doubles the gap, up to this
# (exploring every 32 steps where drafting never pays, C >= 8 here, is a ~1.5% tax).
EXPLORE_MAX_GAP = 512
IDLE_RECHECK = 8  # after this many no-draft plans in a row, only every 8th step is priced
MEMORY = 0.3  # weight of the newest round in a request's acceptance memory
# Tries per position that a drafter's release evidence (its held-out acceptance) counts as before
# served rounds replace it: enough that one unlucky probe does not price a good drafter out.
EVIDENCE_WEIGHT = 8.0
# How far a request's realised drafter acceptance may move its price from what â says (clip of
# accepted / â-expected drafts, each an EMA over the request's drafter rounds).
REALISED_CLIP = (0.25, 2.0)


class CostPolicy:
    def __init__(
        self,
        model: TargetModel,
        config: ProposerConfig,
        slots: int,
        capacity: int,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        self.model, self.slots, self.config = model, slots, config
        self.drafter = DrafterProposer(model, config, slots, capacity)
        # The model-free proposers, by name (each is also a method of its own).
        self.lookups: dict[str, Proposer] = {
            "ngram": PromptLookupProposer(),
            "suffix": SuffixProposer(suffix_cache),
        }
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
        # The last plan's option per decoding request: what each verified draft was expected to
        # bring (read by `scripts/policy_calibration.py`; `expected` is 0 where nothing was priced).
        self.last_options: list[Option] = []
        # This step's drafter rounds of policy requests: index -> (survival from â alone,
        # expected drafts as priced before the request's own record).
        self._expected: dict[int, tuple[list[float], float]] = {}
        # How far suffix drafts' own estimates hold, per source: the request's own prompt and
        # output, or its tenant's earlier responses (cross-request matches err differently).
        self.suffix_reliability = {"own": Reliability(), "tenant": Reliability()}
        # n-gram's chosen drafts promised ~2x what edit accepted (scripts/policy_calibration.py).
        self.ngram_reliability = Reliability(prior=1.0)
        self._methods: list[str] = []  # this step's decoding requests' methods
        self._reset_stats()

    # --- the drafter (install / context) ---------------------------------------------------------

    @property
    def bundle(self) -> DrafterBundle | None:
        return self.drafter.bundle

    @property
    def version(self) -> str | None:
        return self.drafter.version

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def lookup_block(self) -> int:
        """Positions an n-gram round verifies at most (anchor included)."""
        return self.block_size if self.bundle is not None else NGRAM_BLOCK

    def stamp(self, req: Request) -> None:
        """Record on `req` what serves it: the drafter version and the block its rounds verify."""
        if req.method in DRAFTER_METHODS:
            req.drafter_version, req.block_size = self.version, self.block_size
            self.drafter.admit(req)
        elif req.method in LOOKUP_METHODS:  # no drafter: lookups verify up to the proposer's block
            req.drafter_version, req.block_size = None, self.lookup_block

    def install(self, bundle: DrafterBundle | None, version: str | None) -> None:
        self.drafter.install(bundle, version)
        self._reset_stats()

    def _reset_stats(self) -> None:
        k = self.lookup_block
        self.mean_a_hat = None
        # How far â's curves hold on the rounds chosen to draft (chosen where â ran highest).
        self.drafter_reliability = Reliability(prior=1.0)
        # The drafter starts from its own release evidence where its checkpoint carries one (a
        # retrained drafter at τ 2.5 is not the bootstrap's τ 1.5), else from a generic prior.
        ev = self.bundle.evidence if self.bundle is not None else None
        self.stats = {
            "drafter": AcceptanceStats.from_survival(k - 1, ev.survival, EVIDENCE_WEIGHT)
            if ev is not None else AcceptanceStats(k - 1)
        }  # fmt: skip
        # Optimistic n-gram prior: lookup costs no forward, so it gets tried and measured early.
        for name in self.lookups:
            self.stats[name] = AcceptanceStats(k - 1, prior=0.6, prior_weight=4)

    def extend(self, features: torch.Tensor, slot_rows: torch.Tensor, positions: torch.Tensor,
               shared: bool = False) -> None:  # fmt: skip
        self.drafter.extend(features, slot_rows, positions, shared)

    def rebuild(self, live: list[Request], runner: PackedRunner) -> None:
        self.drafter.rebuild(live, runner)

    # --- one step's proposals --------------------------------------------------------------------

    def plan(self, decoding: list[Request], base_rows: int, waiting: bool = True) -> Plan:
        """Proposals for every decoding request. `base_rows`: the step's prefill rows. `waiting`:
        requests queue for a slot (then a token committed early is worth its rate: it frees the
        slot sooner); without a queue the policy drafts for the batch's longest requests together
        or not at all (`lockstep.critical`)."""
        n = len(decoding)
        step = self._by_method(decoding)
        policy = [i for i, r in enumerate(decoding) if r.method == "adaflash-cost" and self.bundle]
        if policy:
            self._price(decoding, policy, step, base_rows, waiting)
        drafted = [i for i in range(n) if i in step.fixed or step.opts[i].proposer == "drafter"]
        step.drafts = [self._chosen(step.proposed, step.opts[i], i) for i in range(n)]
        step.probs, step.a_hat = [None] * n, [None] * n
        self._expected = {}
        if drafted:
            t0 = clock()
            self._draft(decoding, drafted, step)
            self._draft_seconds = clock() - t0
        self._proposed = step.proposed
        self._methods = [r.method for r in decoding]
        proposer = [
            step.opts[i].proposer if step.opts[i].proposer in self.lookups
            else "drafter" if i in drafted else "none"
            for i in range(n)
        ]  # fmt: skip
        self.last_options = step.opts
        verified = {i for i in range(n) if proposer[i] == "drafter" and step.drafts[i]}
        self._expected = {i: e for i, e in self._expected.items() if i in verified}
        V = self.model.config.vocab_size
        return assemble(decoding, step.drafts, step.probs, step.a_hat, proposer, V, self.model.dtype)

    def _by_method(self, decoding: list[Request]) -> StepProposals:
        """What the fixed methods propose: a lookup method its own proposer's drafts, `dflash` and
        `adaflash` the drafter (unless the probe policy skips this round)."""
        k = self.lookup_block
        step = StepProposals(
            [Option("none", 0, 0.0)] * len(decoding), {name: {} for name in self.lookups}, []
        )
        for i, r in enumerate(decoding):
            if r.method in LOOKUP_METHODS:
                drafts = step.proposed[r.method][i] = self._lookup(r.method, r, k)
                step.opts[i] = Option(r.method, len(drafts), 0.0)
            elif r.method in ("dflash", "adaflash"):
                if r.skip_drafts > 0:
                    r.skip_drafts -= 1  # an AR round: k̂ = 1, no draft (probe policy)
                else:
                    step.fixed.append(i)
        return step

    def _price(
        self, decoding: list[Request], policy: list[int], step: StepProposals, base_rows: int, waiting: bool
    ) -> None:
        """`adaflash-cost`'s choice for the requests at `policy`, written into `step.opts`."""
        n, k, bucket = len(decoding), self.lookup_block, SpeculationGuard.bucket(len(decoding))
        idle, gap = self._idle.get(bucket, 0), self._explore_gap.get(bucket, EXPLORE_EVERY)
        # Whether this step forces a drafter round (`_explore`). Never in a lockstep batch (no
        # queue, several requests), so an overdue one there must not force pricing either: it did,
        # and a C = 8 closed loop priced every step after its first 32.
        explore_due = self.steps_since_draft + 1 >= gap and (waiting or len(policy) == 1)
        if n > 1 and idle >= IDLE_RECHECK and idle % IDLE_RECHECK and not explore_due:
            # Priced out at this load: the last plans chose no draft, so most steps skip pricing
            # (its Python costs a few % of a batch step) and run as AR; every IDLE_RECHECK-th step
            # prices again, and exploration still comes every `gap` steps. Not for a lone
            # request: there pricing costs ~1 ms of a ~25 ms step, and suffix matches come and
            # go token by token (an SQL answer reaches a column list an earlier answer had),
            # so skipping 7 of 8 steps missed most of them.
            self._idle[bucket] = idle + 1
            self.steps_since_draft += 1
            return
        # Looked up only when the step is priced: an idle step (above) skips the per-request
        # Python; the index catches up with every token the next time it is asked.
        for name, found in step.proposed.items():
            found.update({i: self._lookup(name, decoding[i], k) for i in policy})
        cands = [self._candidate(decoding[i], {m: p[i] for m, p in step.proposed.items()}, k) for i in policy]
        chosen, step.rate = self._choose(decoding, policy, cands, step, base_rows, waiting)
        priced_out = all(o.proposer == "none" for o in chosen)
        self._idle[bucket] = idle + 1 if priced_out else 0
        if any(o.proposer == "drafter" for o in chosen):
            self._explore_gap[bucket] = EXPLORE_EVERY  # the drafter pays here again
        self.steps_since_draft += 1
        plain = len(policy) == n and not base_rows
        chosen, forced = self._explore(chosen, cands, bucket, gap, n, plain, explore_due)
        step.explore = None if forced is None else policy[forced]
        for i, o in zip(policy, chosen, strict=True):
            step.opts[i] = o
        if any(o.proposer == "drafter" for o in chosen):
            self.steps_since_draft = 0

    def _choose(
        self,
        decoding: list[Request],
        policy: list[int],
        cands: list[Candidate],
        step: StepProposals,
        base_rows: int,
        waiting: bool,
    ) -> tuple[list[Option], float]:
        """The priced choice (`costs.choose`), held to the lockstep rule when nothing waits; with
        `lockstep_min_prob` set, a lockstep plan that drafts nothing gives way to the longest
        requests' sure model-free drafts, if their lockstep value pays (`lockstep.confident`)."""
        n, k = len(decoding), self.lookup_block
        base = base_rows + n + len(step.fixed) * (k - 1)
        base += sum(o.drafts for r, o in zip(decoding, step.opts, strict=True) if r.method in LOOKUP_METHODS)
        self._penalty = self.guard.penalty(n)
        self._requests = n
        chosen, rate = choose(
            cands, self.costs, base, float(n), len(step.fixed), penalty=self._penalty, requests=n
        )
        if not waiting and len(policy) > 1:
            reqs = [decoding[i] for i in policy]
            chosen = lockstep.critical(reqs, chosen)
            chosen = lockstep.lockstep(self.costs, self._penalty, cands, chosen, base, len(step.fixed), n)
            sure = self.config.lockstep_min_prob
            if sure > 0 and all(o.proposer == "none" for o in chosen):
                alt = lockstep.confident(reqs, cands, sure)
                if alt is not None:
                    chosen = lockstep.lockstep(
                        self.costs, self._penalty, cands, alt, base, len(step.fixed), n
                    )
        return chosen, rate

    def _explore(
        self,
        chosen: list[Option],
        cands: list[Candidate],
        bucket: int,
        gap: int,
        n: int,
        plain: bool,
        explore_due: bool,
    ) -> tuple[list[Option], int | None]:
        """The guard's plain step now and then (when the whole step is the policy's decodes), or, when
        `explore_due` (every `gap` steps), one forced drafter round, to keep â and the drafter's
        stats fresh. Not in a lockstep batch (no queue, several requests): one request's round there
        saves the batch no step and pays its whole prompt's context projection plus a block of verify
        rows (0.19 s of a profiled 62 s C = 8 sql cell); a later step with a queue explores instead."""
        if self.guard.want_plain_step(n) and plain:
            return [Option("none", 0, 0.0)] * len(chosen), None  # measure what plain steps deliver
        forced = None  # the index (in `chosen`) of the request forced to draft
        if explore_due:
            # One request drafts its full room, in turn (`_refine` keeps it): a fresh â and acceptance
            # sample for one block's price. Not one whose queued context costs more than a block
            # forward this round (it explores once it has drafted, or its successor does).
            block = self.costs.drafter_block(1)
            able = [j for j, c in enumerate(cands) if c.drafter_limit and c.drafter_setup <= block]
            if able:
                forced = able[self._explore_turn % len(able)]
                self._explore_turn += 1
                chosen[forced] = Option("drafter", cands[forced].drafter_limit, 0.0)
                self._explore_gap[bucket] = min(2 * gap, EXPLORE_MAX_GAP)
        return chosen, forced

    def _lookup(self, name: str, r: Request, k: int) -> list[int]:
        """The request's drafts from one model-free proposer: as many as the block and its
        remaining tokens allow (fewer where the proposer is unsure)."""
        n = room(r, k)
        return self.lookups[name].propose(r, n) if n else []

    @staticmethod
    def _chosen(proposed: dict[str, dict[int, list[int]]], o: Option, i: int) -> list[int]:
        """The drafts a model-free option verifies (the drafter's are filled in by `_draft`)."""
        return proposed[o.proposer][i][: o.drafts] if o.proposer in proposed else []

    def _lookup_survival(self, r: Request, name: str, drafts: list[int]) -> list[float]:
        """A model-free proposal's expected acceptance: the proposer's measured conditionals, the
        first position set to this request's own hit rate with it, times n-gram's reliability
        table (`ngram_reliability`, as for suffix below). A suffix draft carries its own
        estimate (how far the matching occurrences agree): that, times the measured ratio of
        accepted to estimated suffix drafts for estimates like it and from its source
        (`suffix_reliability`), prices it instead — a 30-token match that 5 earlier answers
        continue alike is not a coin flip."""
        if not drafts:
            return []
        if name == "suffix" and len(r.suffix_probs) >= len(drafts):
            return self.suffix_reliability[r.suffix_source].survival(r.suffix_probs[: len(drafts)])
        stats = self.stats[name]
        first = r.accept_ema.get(name, stats.conditional()[0])
        estimate = scaled(stats.survival(), first)[: len(drafts)]
        if name != "ngram":  # a suffix draft without its own estimate
            return estimate
        r.ngram_probs = estimate
        return self.ngram_reliability.survival(estimate)

    def _candidate(self, r: Request, proposed: dict[str, list[int]], k: int) -> Candidate:
        """The request's priced options: each proposer's survival curve and draft limit (none
        from the drafter once its context was dropped past the queue's bound)."""
        n = room(r, k) if self.drafter.can_draft(r) else 0
        ngram = proposed.get("ngram", [])
        mean = self.mean_a_hat or 1.0
        survival = self._drafter_survival(r, r.accept_ema.get("a_hat", mean))[:n] if n else []
        others = {name: (self._lookup_survival(r, name, d), len(d))
                  for name, d in proposed.items() if name != "ngram" and d}  # fmt: skip
        return Candidate(
            self._lookup_survival(r, "ngram", ngram),
            len(ngram),
            survival,
            n,
            others,
            self._setup(r, survival) if n else 0.0,
        )

    def _drafter_survival(self, r: Request | None, a: float, realised: bool = True) -> list[float]:
        """The drafter's survival curve for a request: the measured one scaled by â / mean â (alone
        where `r` is None), calibrated on verified policy rounds (`drafter_reliability`), then
        (`realised`) by the request's own rounds against that (a confident head can keep failing)."""
        curve = rescaled(self.stats["drafter"].survival(), a / max(self.mean_a_hat or 1.0, 1e-3))
        if r is None:
            return curve
        curve = self.drafter_reliability.survival(curve)
        if realised and "drafter_expected" in r.accept_ema:
            got = (r.accept_ema["drafter_accepted"] + 0.5) / (r.accept_ema["drafter_expected"] + 0.5)
            curve = rescaled(curve, min(max(got, REALISED_CLIP[0]), REALISED_CLIP[1]))
        return curve

    def _setup(self, r: Request, survival: list[float]) -> float:
        """The share of the request's queued context projection that one drafter round is charged.
        The first round that drafts pays it all and every later round reuses it, so it is spread
        over the rounds the request has left at this round's expected tokens: next to nothing
        early in a long answer, most of it near the end, where a first draft after a long run of
        lookups would project a whole prompt to save a step or two."""
        rows = self.drafter.pending_rows(r)
        if not rows:
            return 0.0
        left = max(r.params.max_tokens - len(r.output_ids), 1)
        return self.costs.drafter_context(rows) * min(1.0, (1.0 + sum(survival)) / left)

    def _draft(self, decoding: list[Request], drafted: list[int], step: StepProposals) -> None:
        """The drafter's block for the requests at `drafted`; â then sets each one's length (the
        head's k̂ for `adaflash`, the policy's refined choice for `adaflash-cost`)."""
        reqs = [decoding[i] for i in drafted]
        rows = sum(self.drafter.pending_rows(r) for r in reqs)
        t0 = clock()
        self.drafter.project(reqs)
        if rows:
            self.costs.drafter_context.observe(rows, clock() - t0)
        t0 = clock()
        block = self.drafter.forward(reqs)
        # The block forward + length head alone. The context projection above is paid once per
        # committed row, whenever the request drafts next: it has its own curve, priced per
        # request (`_setup`). Counted as a block's cost it priced the drafter out after every long
        # skip (the first draft after a 700-token prompt projects it all, and the curve then held
        # the drafter at several times its cost until it drafted again).
        self.costs.drafter_block.observe(len(reqs), clock() - t0)
        kh = self.drafter.lengths(block)
        for pos, j in enumerate(block.heads):
            i, a = drafted[j], float(block.a_hat[pos])
            step.a_hat[i] = a
            if reqs[j].method == "adaflash-cost":
                kh[j] = self._refine(reqs[j], i, a, step) + 1
        out = self.drafter.tokens(block, kh)
        self.costs.drafter_lm.observe(out.lm_rows, out.lm_seconds)
        for j, i in enumerate(drafted):
            if step.opts[i].proposer in self.lookups:  # the refinement preferred a lookup draft
                step.drafts[i] = self._chosen(step.proposed, step.opts[i], i)
            else:
                step.drafts[i], step.probs[i] = out.tokens[j], out.probs[j]

    def _refine(self, r: Request, i: int, a: float, step: StepProposals) -> int:
        """With â known, the best of drafter / lookups / none for this request (block forward paid)."""
        k = self.block_size
        r.accept_ema["a_hat"] = (1 - MEMORY) * r.accept_ema.get("a_hat", a) + MEMORY * a
        self.mean_a_hat = a if self.mean_a_hat is None else 0.98 * self.mean_a_hat + 0.02 * a
        cand = self._candidate(r, {m: p.get(i, []) for m, p in step.proposed.items()}, k)
        cand.drafter_survival = self._drafter_survival(r, a)[: cand.drafter_limit]
        rows = max(sum(o.drafts for o in step.opts), 1)
        extra = self.costs.target(rows + 1, self._requests) - self.costs.target(rows, self._requests)
        lm_price = self._penalty * self.costs.drafter_lm(rows) / rows
        o = _pick(cand, step.rate, max(self._penalty * extra, 0.0), lm_price, 0.0)
        if i == step.explore:  # a forced round is an acceptance sample: verified as drafted, not refined
            o = Option("drafter", cand.drafter_limit, sum(cand.drafter_survival))
        step.opts[i] = o
        if o.proposer == "drafter":  # what â promised, to measure the table and the request against
            raw = self._drafter_survival(None, a)[: o.drafts]  # the table's survival is prefix-wise
            self._expected[i] = (raw, sum(self.drafter_reliability.survival(raw)))
        return o.drafts if o.proposer == "drafter" else 0

    # --- feedback from verification --------------------------------------------------------------

    def _calibrate(self, name: str, r: Request, known: int, hits: int, verified: bool) -> None:
        """A model-free draft's outcome against its own estimate (its reliability table). n-gram
        learns from verified rounds only: those were chosen where its estimates ran highest."""
        if name == "suffix":
            self.suffix_reliability[r.suffix_source].observe(r.suffix_probs, known, hits)
        elif name == "ngram" and verified:
            self.ngram_reliability.observe(r.ngram_probs, known, hits)

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
            if i in self._expected:
                self.drafter_reliability.observe(self._expected[i][0], drafted, accepted[i])
                for key, v in (("drafter_accepted", accepted[i]), ("drafter_expected", self._expected[i][1])):
                    r.accept_ema[key] = (1 - MEMORY) * r.accept_ema.get(key, v) + MEMORY * v
            for name, found in self._proposed.items():
                proposal = found.get(i)
                if p == name:
                    hits = accepted[i]
                    self._calibrate(name, r, drafted, hits, verified=True)
                elif proposal and r.method == "adaflash-cost":
                    lo = int(doff[i])
                    new = plan.drafts[lo : lo + accepted[i]].tolist() + [nxt[i]]
                    tried = min(len(proposal), len(new))
                    hits = next((j for j in range(tried) if proposal[j] != new[j]), tried)
                    self.stats[name].observe(tried, hits)
                    known = len(proposal) if hits < tried else tried  # a miss tells every position
                    self._calibrate(name, r, known, hits, verified=False)
                else:
                    continue
                hit = float(hits > 0)
                r.accept_ema[name] = (1 - MEMORY) * r.accept_ema.get(name, hit) + MEMORY * hit
        self._proposed = {}
        self._expected = {}

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
