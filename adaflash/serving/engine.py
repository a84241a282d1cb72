"""The serving engine: the API, the step loop and `step` for every method on one engine.

One step (vLLM/SGLang style — the scheduler decides what runs, the runner how):
  1. between steps only: apply a staged drafter swap (hot reload), drop cancelled requests;
  2. admit waiting requests (EMA admission, `Scheduler`);
  3. proposals for every running request (`CostPolicy`: the drafter's block + length head, prompt
     lookup, the suffix cache, or the cost-aware choice among them), drafter logits only for kept
     positions;
  4. ONE packed target forward over [prefills of the admitted] + [Σ k̂_i verify tokens];
  5. verify each request (`verifier`: greedy or speculative sampling), commit the anchor and the
     accepted drafts, extend the drafter context with their target features, record the round
     and stream the new tokens.
Requests of different methods may share a step, so methods are compared on one engine.

Threading: `submit`/`cancel`/`stage_drafter` may be called from any thread; `step` runs on one
(the step-loop thread of `start()`, or the caller's, as the benchmark does). Callbacks (sinks,
observers) run on the step-loop thread and must not block.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import torch

from adaflash import kernels
from adaflash.errors import InputError
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.packed import LARGE_ROWS
from adaflash.models.targets import Target
from adaflash.serving import verifier
from adaflash.serving.calibration import calibrate
from adaflash.serving.config import EngineConfig, StepStats
from adaflash.serving.policy import CostPolicy
from adaflash.serving.prefix_cache import PrefixCache
from adaflash.serving.proposer import ProposerConfig
from adaflash.serving.proposer import clock as policy_clock
from adaflash.serving.request import (
    DRAFTER_METHODS,
    METHODS,
    MIN_TEMPERATURE,
    GenParams,
    Request,
    RoundStat,
    Status,
    check_params,
    check_prompt,
)
from adaflash.serving.runner import PackedBatch, PackedRunner, Segment
from adaflash.serving.scheduler import Scheduler, SchedulerConfig
from adaflash.serving.step_loop import EngineFailed, StepLoop
from adaflash.serving.suffix_cache import SuffixCache

log = logging.getLogger(__name__)

# Callers build and run requests from here: the engine is the serving room's front door.
__all__ = ["Engine", "EngineConfig", "EngineFailed", "GenParams", "Request", "StepStats"]


class Engine(StepLoop):
    def __init__(
        self,
        target: Target,
        drafter: DrafterBundle | None = None,
        config: EngineConfig | None = None,
        drafter_version: str | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        """`suffix_cache`: one that outlives this engine (the shift experiment's learner keeps
        its cache across rounds and engines); default a new one from `config.suffix`."""
        self.target = target
        self.config = c = config or EngineConfig()
        if c.method not in METHODS:
            raise InputError(f"unknown method {c.method!r}: choose one of {', '.join(METHODS)}")
        self.model = target.model
        self.capacity = min(c.max_model_len, target.max_context)
        self.runner = PackedRunner(self.model, c.max_running, self.capacity)
        self.scheduler = Scheduler(
            SchedulerConfig(c.max_running, c.max_queue, c.kv_budget_tokens, c.step_token_budget, c.beta),
            self.capacity,
        )
        self.eos = set(target.tokenizer.eos_token_ids)
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache(c.suffix)
        self.prefix_cache = PrefixCache(c.prefix)
        proposer = ProposerConfig(c.gamma, c.shadow_a_hat, c.probe_every, c.lockstep_min_prob)
        self.policy = CostPolicy(self.model, proposer, c.max_running, self.capacity, self.suffix_cache)
        self.policy.install(drafter, drafter_version)
        self._pack()
        # Only `adaflash-cost` reads the cost curves, and it needs a length head; a drafter that
        # arrives later by hot reload starts its curves from the first steps' measurements.
        if c.calibrate and drafter is not None and drafter.length_head is not None:
            calibrate(self.policy, self.runner, c.step_token_budget)
        self._staged: tuple[DrafterBundle, str] | None = None
        self._staged_lock = threading.Lock()
        self.step_observers: list[Callable[[StepStats, Engine], None]] = []
        self.reloads = 0
        self.last_step: StepStats | None = None
        self._init_loop()

    @torch.no_grad()
    def _pack(self) -> None:
        """Pack the target's (and the drafter's) linear layers and load the kernels now, with an
        untimed forward on a free slot whose rows stay uncommitted. Both happen on first use and
        then stay with the model for the process; done here, neither a process's first request
        nor a bench's first timed cell pays for them (on SmolLM2 such a cell runs at 40 tok/s
        where the next one runs at 99)."""
        rows = min(LARGE_ROWS + 1, self.capacity)  # a prefill's size: past LARGE_ROWS its GEMM is probed
        bundle = self.policy.bundle
        capture = tuple(bundle.config.target_layer_ids) if bundle is not None else ()
        hidden, features = self.runner.forward(PackedBatch.build([Segment(0, 0, [0] * rows)]), capture)
        self.model.logits(hidden[-1:])
        self.runner.last_num_rows = 0
        if bundle is not None:
            drafter, k = bundle.drafter, bundle.config.block_size
            context = drafter.context_kv(features[None], torch.arange(rows)[None])
            block = self.model.embed(torch.zeros(1, k, dtype=torch.long))
            positions, visible = torch.arange(rows, rows + k)[None], torch.ones(1, k, rows, dtype=torch.bool)
            drafter(block, positions, context, visible)

    # --- public API ------------------------------------------------------------------------------

    @property
    def bundle(self) -> DrafterBundle | None:
        return self.policy.bundle

    @property
    def drafter_version(self) -> str | None:
        return self.policy.version

    @property
    def block_size(self) -> int:
        return self.policy.block_size

    @property
    def idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.pending

    def validate(self, req: Request) -> None:
        """Raise InputError for a request this engine cannot serve as given."""
        self.validate_params(req)
        # The length first: it costs nothing, and a prompt of millions of ids is refused before
        # anything scans it (submit runs on the server's event loop).
        self.check_length(len(req.prompt_ids), req.params.max_tokens)
        check_prompt(req.prompt_ids, self.target.config.vocab_size)

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise InputError when a prompt this long, plus max_tokens, can never be served here."""
        limit = min(self.capacity, self.scheduler.kv_budget)
        if prompt_tokens + max_tokens > limit:
            raise InputError(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the "
                f"server's per-request limit of {limit} tokens"
            )

    def validate_params(self, req: Request) -> None:
        """The method and sampling parameters alone (the server checks them before encoding)."""
        b = self.bundle
        method = req.params.method or self.config.method
        check_params(req.params, method, b is not None, b is not None and b.length_head is not None)

    def submit(self, req: Request) -> Request:
        """Queue a request (raises InputError, QueueFull or EngineFailed); returns it for chaining."""
        if self.failure is not None:
            raise EngineFailed(f"the engine's step loop has stopped: {self.failure!r}")
        self.validate(req)
        req.method = req.params.method or self.config.method
        if req.params.temperature < MIN_TEMPERATURE:
            req.params.temperature = 0.0  # greedy: see MIN_TEMPERATURE
        if req.params.temperature > 0:
            seed = req.params.seed if req.params.seed is not None else int.from_bytes(uuid.uuid4().bytes[:6])
            req.generator = torch.Generator().manual_seed(seed)
        req.arrival = time.perf_counter()
        self.scheduler.add(req)
        self._wake.set()
        return req

    def stage_drafter(self, bundle: DrafterBundle, version: str) -> None:
        """Swap in an already loaded and validated drafter at the next step boundary."""
        with self._staged_lock:
            self._staged = (bundle, version)
        self._wake.set()

    # --- one step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> StepStats | None:
        self._apply_staged()
        self._reap_cancelled()
        admitted = self.scheduler.admit()
        decoding = [r for r in self.scheduler.running.values() if r.status is Status.RUNNING]
        if not admitted and not decoding:
            return None
        t0, cpu0 = time.perf_counter(), policy_clock()
        stats = StepStats(admitted=len(admitted), running=len(admitted) + len(decoding))
        for r in admitted:
            r.status = Status.RUNNING
            self.policy.stamp(r)
        starts = self._reuse_prefixes(admitted)
        stats.prefill_tokens = sum(len(r.prompt_ids) - s for r, s in zip(admitted, starts, strict=True))
        plan = self.policy.plan(decoding, stats.prefill_tokens, waiting=bool(self.scheduler.pending))
        segments = [Segment(r.slot, s, r.prompt_ids[s:]) for r, s in zip(admitted, starts, strict=True)]
        segments += [Segment(r.slot, r.kv_len, t) for r, t in zip(decoding, plan.verify_tokens, strict=True)]
        batch = PackedBatch.build(segments)
        capture = self._capture_layers(admitted, decoding)
        t_fwd = policy_clock()
        hidden, features = self.runner.forward(batch, capture)
        n_pre = len(admitted)
        first_logits = self.model.logits(hidden[batch.cu[1 : n_pre + 1] - 1]) if admitted else None
        t_logits = self.model.logits(hidden[int(batch.cu[n_pre]) :]) if decoding else None
        t_fwd = policy_clock() - t_fwd
        stats.target_rows = batch.num_rows
        stats.verify_tokens, stats.verify_lens = sum(plan.khat), list(plan.khat)
        stats.proposers = list(plan.proposer)

        now = time.perf_counter()
        committed_rows: list[torch.Tensor] = []
        first = verifier.sample_first(admitted, first_logits) if admitted else []
        for j, (r, tok) in enumerate(zip(admitted, first, strict=True)):
            if r.error is not None:  # this request failed alone; the batch goes on
                self._finish_failed(r, now)
                continue
            if r.method in DRAFTER_METHODS:  # every prompt token (ar requests need no context)
                committed_rows.append(torch.arange(int(batch.cu[j]), int(batch.cu[j + 1])))
            r.kv_len = len(r.prompt_ids)
            own = features[int(batch.cu[j]) : int(batch.cu[j + 1])] if features is not None else None
            self._remember_prefix(r, starts[j], own, capture)
            self._emit(r, [tok], now, first_logits[j : j + 1])
            stats.emitted += 1
        if decoding:
            accepted, nxt = verifier.verify(decoding, plan, t_logits)
            self.policy.observe(decoding, plan, accepted, nxt)
            stats.accepted = accepted
            doff = kernels.draft_offsets(plan.cu)
            for i, r in enumerate(decoding):
                if r.error is not None:
                    self._finish_failed(r, now)
                    continue
                acc, row0 = accepted[i], int(batch.cu[n_pre + i])
                if r.method in DRAFTER_METHODS:
                    committed_rows.append(torch.arange(row0, row0 + acc + 1))
                start = len(r.output_ids) - 1
                r.rounds.append(RoundStat(start, plan.khat[i], acc, plan.a_hat[i], plan.proposer[i]))
                r.kv_len += acc + 1
                new = plan.drafts[int(doff[i]) : int(doff[i]) + acc].tolist() + [nxt[i]]
                self._emit(r, new, now, t_logits[int(plan.cu[i]) : int(plan.cu[i]) + acc + 1])
                stats.emitted += len(new)
        if committed_rows:
            rows = torch.cat(committed_rows)
            self.policy.extend(features[rows], batch.slot_rows[rows], batch.positions[rows])

        for r in admitted + decoding:
            if r.finished:
                self._release(r)
        mean_k = sum(plan.khat) / len(plan.khat) if plan.khat else None
        self.scheduler.observe(len(admitted) + len(decoding), mean_k)
        stats.seconds = time.perf_counter() - t0
        cpu = policy_clock() - cpu0
        self.policy.observe_step(batch.num_rows, t_fwd, cpu, plan, stats.emitted, bool(admitted),
                                   len(segments))  # fmt: skip
        self.last_step = stats
        for obs in self.step_observers:
            obs(stats, self)
        return stats

    def _capture_layers(self, admitted: list[Request], decoding: list[Request]) -> tuple[int, ...]:
        """The target layers whose rows this step keeps: the drafter's, when a request drafts.
        Prefills the prefix cache will keep (`_remember_prefix`) capture them too (a copy of 5
        layers' rows), so a drafter request can later reuse the head an `ar` request left."""
        kept = any(r.use_prefix_cache and r.consent for r in admitted)
        speculating = kept or any(r.method in DRAFTER_METHODS for r in admitted + decoding)
        return self._drafter_layers if speculating else ()

    @property
    def _drafter_layers(self) -> tuple[int, ...]:
        """The target layers the installed drafter reads (none without a drafter)."""
        return tuple(self.bundle.config.target_layer_ids) if self.bundle else ()

    # --- prefix reuse (`prefix_cache.py`) ---------------------------------------------------------

    def _reuse_prefixes(self, admitted: list[Request]) -> list[int]:
        """Copy each admitted request's longest cached prompt head into its slot; returns where
        each prefill starts. A drafter request also gets the head's target features queued for
        its drafter context, so the chain stops at a block cached without them."""
        starts = []
        for r in admitted:
            chain: list = []
            if r.use_prefix_cache and r.error is None:
                layers = (self._drafter_layers or None) if r.method in DRAFTER_METHODS else None
                chain = self.prefix_cache.match(r.tenant_id, r.prompt_ids, layers)
            bt = self.prefix_cache.config.block_tokens
            n = bt * len(chain)
            if chain:
                ck, cv = self.runner.cache.k[:, r.slot], self.runner.cache.v[:, r.slot]
                ck[:, :, :n] = torch.cat([b.k for b in chain], dim=2)
                cv[:, :, :n] = torch.cat([b.v for b in chain], dim=2)
                if layers is not None:  # the blocks' own tensors, queued without a copy
                    slot_rows = torch.full((bt,), r.slot, dtype=torch.long)
                    for i, blk in enumerate(chain):
                        rows = torch.arange(i * bt, (i + 1) * bt)
                        self.policy.extend(blk.features, slot_rows, rows, shared=True)
            starts.append(n)
        return starts

    def _remember_prefix(self, r: Request, start: int, features: torch.Tensor | None,
                         layers: tuple[int, ...]) -> None:  # fmt: skip
        """After a prefill: its prompt's full blocks join the tenant's cache (a request without
        feedback consent adds nothing), features included where the step captured them."""
        if r.use_prefix_cache and r.consent:
            cache = self.runner.cache
            self.prefix_cache.insert(r.tenant_id, r.prompt_ids, cache.k[:, r.slot], cache.v[:, r.slot],
                                     features, layers, start)  # fmt: skip

    # --- committing, hot reload ------------------------------------------------------------------

    def _emit(self, r: Request, new: list[int], now: float, logits: torch.Tensor) -> None:
        """Commit `new` (row j of `logits`: the target's logits token j was committed from)."""
        lps = verifier.committed_logprobs(r, new, logits)
        self._notify(r, r.commit(new, self.eos, lambda ids: self.target.tokenizer.decode(ids), now, lps))

    def _apply_staged(self) -> None:
        """Hot reload between steps: the context cache belongs to the drafter (its fc and k/v
        projections), so it is rebuilt for in-flight requests."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        self.policy.install(*staged)
        self.reloads += 1
        live = [r for r in self.scheduler.running.values()
                if r.status is Status.RUNNING and r.kv_len > 0 and r.method in DRAFTER_METHODS]  # fmt: skip
        self.policy.rebuild(live, self.runner)
        for r in live:
            self.policy.stamp(r)
