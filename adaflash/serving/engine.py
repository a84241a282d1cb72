"""The serving engine: request state objects, one step loop for `ar`, `dflash` and `adaflash`.

One step (vLLM/SGLang style — the scheduler decides what runs, the runner how):
  1. apply a staged drafter swap (hot reload) and drop cancelled requests — between steps only;
  2. admit waiting requests (EMA admission, `Scheduler`);
  3. one drafter forward for every running request that speculates → length head (adaflash) →
     drafter logits only for each request's k̂_i − 1 kept positions;
  4. ONE packed target forward over [prefills of the admitted] + [Σ k̂_i verify tokens];
  5. verify each request (greedy or speculative sampling, packed kernels), commit the anchor and
     the accepted drafts, extend the drafter context with their target features, record the
     round (start, k̂, accepted, â) and stream the new tokens.
`ar` requests run the same loop with k̂ = 1 and no draft, `dflash` with k̂ = k, so methods are
compared on one engine; requests of different methods may share a step.

Threading: `submit`/`cancel`/`stage_drafter` may be called from any thread; `step` runs on one
(the step-loop thread started by `start()`, or the caller's when driven synchronously, as the
benchmark does). Callbacks (`Request.sink`, finish observers) run on the step-loop thread and
must not block: the server hands tokens to asyncio queues, feedback goes to its own thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from adaflash import kernels
from adaflash.errors import AdaFlashError, InputError
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.length_head import verify_lengths
from adaflash.models.ngram import propose as ngram_propose
from adaflash.models.targets import Target
from adaflash.serving.runner import DrafterSlots, PackedBatch, PackedRunner, Segment
from adaflash.serving.scheduler import Scheduler, SchedulerConfig
from adaflash.serving.speculative import METHODS as DECODER_METHODS

# `ngram` is prompt lookup (vLLM's `ngram`, SGLang's NGRAM): drafts from the request's own tokens,
# no drafter, verified like dflash. Methods in DRAFTER_METHODS run the drafter and keep its context.
METHODS: tuple[str, ...] = (*DECODER_METHODS, "ngram")
DRAFTER_METHODS = ("dflash", "adaflash")
NGRAM_BLOCK = 8  # anchor + up to 7 looked-up drafts when no drafter fixes the block size

log = logging.getLogger(__name__)

# Temperatures below this sample as greedy decoding (vLLM's _SAMPLING_EPS): logits / T overflows
# to inf for T ~ 1e-40, softmax turns into NaN and multinomial raises.
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed's range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Consecutive failed steps (not pinned on one request) after which the step loop gives up: the
# process should then exit so that a supervisor restarts it.
MAX_STEP_FAILURES = 3


class EngineFailed(AdaFlashError):
    """The step loop has stopped (repeated failures): nothing can be served until a restart."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    method: str | None = None  # None: the engine's default method
    top_p: float = 1.0  # nucleus filter, applied to target and draft distributions alike
    top_k: int = 0  # 0: no top-k filter
    stop: tuple[str, ...] = ()  # stop sequences, matched on the committed (detokenised) text


@dataclass
class RoundStat:
    start: int  # output index of the round's anchor (feedback schema's convention)
    verify_len: int  # k̂, anchor included
    accepted: int  # drafted tokens accepted
    a_hat: float | None = None


# sink(request, new_token_ids, finished): called on the step-loop thread.
Sink = Callable[["Request", list[int], bool], None]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: GenParams = field(default_factory=GenParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt_text: str = ""
    tenant_id: str = "anonymous"
    consent: bool = True
    domain: str | None = None
    sink: Sink | None = None
    # --- state, owned by the engine -------------------------------------------------------
    method: str = "ar"
    status: Status = Status.WAITING
    slot: int = -1
    kv_len: int = 0  # committed tokens in the target KV (and drafter context)
    output_ids: list[int] = field(default_factory=list)
    rounds: list[RoundStat] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter per output token
    arrival: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None
    finish_reason: str | None = None
    drafter_version: str | None = None
    block_size: int = 1  # the serving drafter's k (1 for `ar`)
    skip_drafts: int = 0  # rounds left to run without drafting (probe policy)
    cancelled: bool = False
    generator: torch.Generator | None = None
    error: str | None = None  # why this request failed (finish_reason "error"); others go on
    error_kind: str = "invalid"  # "invalid": its own inputs/numerics; "server": a failed step
    stop_index: int | None = None  # a stop sequence starts at this index of the output text

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.finish_time - self.arrival if self.finish_time is not None else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass
class EngineConfig:
    method: str = "adaflash"  # default for requests that do not name one
    gamma: float = 1.0
    max_running: int = 32
    max_queue: int = 64
    max_model_len: int = 1024  # KV slot capacity per request (prompt + max_tokens)
    step_token_budget: int = 1024
    kv_budget_tokens: int | None = None
    beta: float = 0.5
    # Also run the length head on fixed-k (dflash) blocks and record â: those rounds are not
    # censored by k̂, so (â, accepted) pairs calibrate the head (benchmark). k̂ stays k.
    shadow_a_hat: bool = False
    # Probe policy for weak drafters: after an adaflash round whose head chose k̂ = 1, the next
    # probe_every − 1 rounds of that request skip the drafter and run as plain AR rounds (the
    # block forward costs more than a 1-token verify at high concurrency). 1 = draft every round
    # (the method as published).
    probe_every: int = 1


@dataclass
class StepStats:
    prefill_tokens: int = 0
    verify_tokens: int = 0  # Σ k̂_i target rows spent on verification
    verify_lens: list[int] = field(default_factory=list)  # k̂_i per decoding request
    accepted: list[int] = field(default_factory=list)
    target_rows: int = 0  # rows the packed target forward ran (prefill + verify)
    admitted: int = 0
    running: int = 0
    emitted: int = 0  # output tokens committed this step
    seconds: float = 0.0


def _probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-wise softmax(logits / T) in >= fp32 (a bf16 target must not quantise acceptance),
    then the per-row top-k / top-p filters."""
    prec = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(prec) / temperature.to(prec)[:, None], dim=-1)
    if top_p is None or top_k is None:
        return probs
    return filter_top_k_top_p(probs, top_p, top_k)


def filter_top_k_top_p(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k most likely entries (0: all), then the smallest prefix of those whose
    renormalised mass reaches top_p (vLLM's order); renormalise. The most likely entry always
    survives. Speculative sampling stays lossless against the filtered target distribution when
    the target's p and the drafter's q are filtered by this same function (as vLLM and SGLang do):
    the verifier's guarantee holds for any p and q."""
    V = probs.shape[-1]
    active = (top_k > 0) & (top_k < V) | (top_p < 1)
    if not bool(active.any()):
        return probs
    out = probs.clone()
    rows = active.nonzero().squeeze(1)
    p = probs[rows]
    sorted_p, order = p.sort(-1, descending=True)
    rank = torch.arange(V)[None, :]
    k = torch.where(top_k[rows] > 0, top_k[rows], V)
    keep = rank < k[:, None]
    kept = sorted_p * keep
    kept = kept / kept.sum(-1, keepdim=True)
    before = kept.cumsum(-1) - kept  # mass of the more likely entries
    tp = top_p[rows].to(p.dtype)[:, None]
    keep &= (before < tp) | (tp >= 1)
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    f = p * mask
    out[rows] = f / f.sum(-1, keepdim=True)
    return out


def _bad_rows(probs: torch.Tensor) -> torch.Tensor:
    """Rows that are not a distribution (NaN/inf, or no mass): multinomial would raise."""
    s = probs.sum(-1)
    return ~(torch.isfinite(probs).all(-1) & (s > 0) & torch.isfinite(s))


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: DrafterBundle | None = None,
        config: EngineConfig | None = None,
        drafter_version: str | None = None,
    ) -> None:
        self.target = target
        self.config = config or EngineConfig()
        c = self.config
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
        self.bundle: DrafterBundle | None = None
        self.drafter_version: str | None = None
        self.dslots: DrafterSlots | None = None
        self._install(drafter, drafter_version)
        self._staged: tuple[DrafterBundle, str] | None = None
        self._staged_lock = threading.Lock()
        self._cancel: set[str] = set()
        self._cancel_lock = threading.Lock()
        self.observers: list[Callable[[Request], None]] = []  # called once per finished request
        self.step_observers: list[Callable[[StepStats, Engine], None]] = []
        self.reloads = 0
        self.last_step: StepStats | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # --- public API ------------------------------------------------------------------------------

    def validate(self, req: Request) -> None:
        """Raise InputError for a request this engine cannot serve as given."""
        self.validate_params(req)
        self._validate_prompt(req)

    def validate_params(self, req: Request) -> None:
        """The method and sampling parameters alone (the server checks them before encoding)."""
        p = req.params
        method = p.method or self.config.method
        if method not in METHODS:
            raise InputError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
        if method in DRAFTER_METHODS and self.bundle is None:
            raise InputError(f"method {method!r} needs a drafter; this server runs without one")
        if method == "adaflash" and self.bundle.length_head is None:
            raise InputError("method 'adaflash' needs a drafter with a length head")
        if not math.isfinite(p.temperature) or p.temperature < 0:
            raise InputError(f"invalid temperature {p.temperature}: must be a finite number >= 0")
        if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
            raise InputError(f"invalid top_p {p.top_p}: must be in (0, 1]")
        if not isinstance(p.top_k, int) or p.top_k < 0:
            raise InputError(f"invalid top_k {p.top_k}: must be an integer >= 0 (0: no filter)")
        if p.seed is not None and not (isinstance(p.seed, int) and SEED_MIN <= p.seed <= SEED_MAX):
            raise InputError(f"invalid seed: must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        if any(not isinstance(x, str) or not x for x in p.stop):
            raise InputError("stop sequences must be non-empty strings")
        if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
            raise InputError("max_tokens must be >= 1")

    def _validate_prompt(self, req: Request) -> None:
        p = req.params
        if not req.prompt_ids:
            raise InputError("empty prompt")
        if not all(isinstance(t, int) for t in req.prompt_ids):
            raise InputError("prompt token ids must be integers")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.target.config.vocab_size:
            raise InputError("prompt contains token ids outside the target vocabulary")
        if not self.scheduler.fits(req):
            raise InputError(
                f"prompt of {len(req.prompt_ids)} tokens + max_tokens {p.max_tokens} exceeds the "
                f"server's per-request limit of {min(self.capacity, self.scheduler.kv_budget)} tokens"
            )

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

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request; its slot is freed before the next step."""
        with self._cancel_lock:
            self._cancel.add(request_id)
        self._wake.set()

    def stage_drafter(self, bundle: DrafterBundle, version: str) -> None:
        """Swap in an already loaded and validated drafter at the next step boundary."""
        with self._staged_lock:
            self._staged = (bundle, version)
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.pending

    @property
    def block_size(self) -> int:
        return self.bundle.drafter.block_size if self.bundle else 1

    # --- the step-loop thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    stats = self.step()
                except Exception as exc:  # noqa: BLE001 - not pinned on one request: fail the step's
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    self.abort_running(exc)
                    if failures >= MAX_STEP_FAILURES:
                        raise
                    continue
                if stats is None:
                    self._wake.wait(0.05)
                    self._wake.clear()
                else:
                    failures = 0  # a step that did work: the trouble was not persistent
        except BaseException as exc:  # a bug: keep it visible on /health instead of a silent hang
            self.failure = exc
            self.abort_running(exc)
            for r in list(self.scheduler.pending):  # nobody will ever admit them: fail them now
                if self.scheduler.remove_pending(r):
                    self._fail(r, f"the engine stopped: {exc!r}", "server")
                    r.status, r.finish_time = Status.FINISHED, time.perf_counter()
                    self._notify(r, [])
            raise

    def abort_running(self, exc: BaseException) -> None:
        """Fail every running request (a step raised and its state is unknown); free their slots
        so the loop can go on with the others still waiting."""
        for r in list(self.scheduler.running.values()):
            if not r.finished:
                self._fail(r, f"internal error in the engine step: {exc!r}", "server")
                r.status = Status.FINISHED
                r.finish_time = time.perf_counter()
            try:
                self.scheduler.finish(r)
            except Exception:  # noqa: BLE001
                log.exception("could not free the slot of %s", r.request_id)
            self._notify(r, [])

    def run_until_idle(self) -> None:
        """Drive the loop on the calling thread until nothing waits or runs (tests, benchmark)."""
        while self.step() is not None:
            pass

    # --- one step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> StepStats | None:
        self._apply_staged()
        self._reap_cancelled()
        admitted = self.scheduler.admit()
        decoding = [r for r in self.scheduler.running.values() if r.status is Status.RUNNING]
        if not admitted and not decoding:
            return None
        t0 = time.perf_counter()
        stats = StepStats(admitted=len(admitted), running=len(admitted) + len(decoding))
        for r in admitted:
            r.status = Status.RUNNING
            if r.method in DRAFTER_METHODS:
                r.drafter_version, r.block_size = self.drafter_version, self.block_size

        plan = self._draft(decoding)
        segments = [Segment(r.slot, 0, r.prompt_ids) for r in admitted]
        segments += [
            Segment(r.slot, r.kv_len, toks) for r, toks in zip(decoding, plan.verify_tokens, strict=True)
        ]
        batch = PackedBatch.build(segments)
        speculating = any(r.method in DRAFTER_METHODS for r in admitted + decoding)
        capture = tuple(self.bundle.config.target_layer_ids) if self.bundle and speculating else ()
        hidden, features = self.runner.forward(batch, capture)
        stats.target_rows = batch.num_rows
        stats.prefill_tokens = sum(len(r.prompt_ids) for r in admitted)
        stats.verify_tokens = sum(plan.khat)
        stats.verify_lens = list(plan.khat)

        now = time.perf_counter()
        n_pre = len(admitted)
        committed_rows: list[torch.Tensor] = []
        if admitted:
            last_rows = batch.cu[1 : n_pre + 1] - 1
            first = self._sample_first(admitted, self.model.logits(hidden[last_rows]))
            for j, r in enumerate(admitted):  # every prompt token (ar requests need no context)
                if r.method in DRAFTER_METHODS and r.error is None:
                    committed_rows.append(torch.arange(int(batch.cu[j]), int(batch.cu[j + 1])))
            for r, tok in zip(admitted, first, strict=True):
                if r.error is not None:  # this request failed alone; the batch goes on
                    self._finish_failed(r, now)
                    continue
                r.kv_len = len(r.prompt_ids)
                self._emit(r, [tok], now)
                stats.emitted += 1
        if decoding:
            v_rows = torch.arange(int(batch.cu[n_pre]), batch.num_rows)
            t_logits = self.model.logits(hidden[v_rows])
            accepted, nxt = self._verify(decoding, plan, t_logits)
            stats.accepted = accepted
            doff = kernels.draft_offsets(plan.cu)
            for i, r in enumerate(decoding):
                if r.error is not None:
                    self._finish_failed(r, now)
                    continue
                acc = accepted[i]
                seg = n_pre + i
                if r.method in DRAFTER_METHODS:
                    committed_rows.append(torch.arange(int(batch.cu[seg]), int(batch.cu[seg]) + acc + 1))
                r.rounds.append(RoundStat(len(r.output_ids) - 1, plan.khat[i], acc, plan.a_hat[i]))
                r.kv_len += acc + 1
                new = plan.drafts[int(doff[i]) : int(doff[i]) + acc].tolist() + [nxt[i]]
                self._emit(r, new, now)
                stats.emitted += len(new)
        if self.dslots is not None and committed_rows:
            rows = torch.cat(committed_rows)
            self.dslots.extend(features[rows], batch.slot_rows[rows], batch.positions[rows])

        for r in admitted + decoding:
            if r.finished:
                self._release(r)
        mean_k = sum(plan.khat) / len(plan.khat) if plan.khat else None
        self.scheduler.observe(len(admitted) + len(decoding), mean_k)
        stats.seconds = time.perf_counter() - t0
        self.last_step = stats
        for obs in self.step_observers:
            obs(stats, self)
        return stats

    # --- step pieces ------------------------------------------------------------------------------

    @dataclass
    class _Plan:
        verify_tokens: list[list[int]]
        khat: list[int]
        a_hat: list[float | None]
        drafts: torch.Tensor  # packed drafted tokens (k̂_i − 1 per request)
        d_probs: torch.Tensor | None  # [len(drafts), V] draft distributions (sampling rows only)
        cu: torch.Tensor  # packed verify boundaries (k̂_i per request)

    def _draft(self, decoding: list[Request]) -> _Plan:
        n = len(decoding)
        khat = [1] * n
        a_hat: list[float | None] = [None] * n
        drafts_per: list[list[int]] = [[] for _ in range(n)]
        probs_per: list[torch.Tensor | None] = [None] * n
        spec = []
        for i, r in enumerate(decoding):
            if r.method == "ar":
                continue
            if r.method == "ngram":
                self._ngram_draft(r, i, khat, drafts_per, probs_per)
                continue
            if r.skip_drafts > 0:
                r.skip_drafts -= 1  # an AR round: k̂ = 1, no draft
                continue
            spec.append(i)
        if spec and self.bundle is not None:
            d = self.bundle.drafter
            k = d.block_size
            reqs = [decoding[i] for i in spec]
            block = torch.full((len(reqs), k), d.config.mask_token_id, dtype=torch.long)
            block[:, 0] = torch.tensor([r.output_ids[-1] for r in reqs])
            slots = torch.tensor([r.slot for r in reqs])
            lengths = torch.tensor([r.kv_len for r in reqs])
            hidden = self.dslots.draft_hidden(slots, lengths, self.model.embed(block))
            kh = torch.full((len(reqs),), k, dtype=torch.long)
            ada = [j for j, r in enumerate(reqs) if r.method == "adaflash"]
            heads = ada
            if self.config.shadow_a_hat and self.bundle.length_head is not None:
                heads = list(range(len(reqs)))
            if heads:
                ah = self.bundle.length_head(hidden[heads])
                for j, a in zip(heads, ah.tolist(), strict=True):
                    a_hat[spec[j]] = a
                khat_all = verify_lengths(ah, k, self.config.gamma)
                for pos, j in enumerate(heads):
                    if reqs[j].method == "adaflash":
                        kh[j] = khat_all[pos]
                        if kh[j] == 1:
                            reqs[j].skip_drafts = self.config.probe_every - 1
            # A round yields at most k̂ tokens: never verify past max_tokens.
            remaining = torch.tensor([r.params.max_tokens - len(r.output_ids) for r in reqs])
            kh = torch.minimum(kh, remaining)
            keep = torch.arange(1, k)[None, :] < kh[:, None]  # [R, k-1]
            # Only the kept positions go through the LM head (its cost dominates the drafter).
            d_logits = self.model.logits(hidden[:, 1:][keep])
            owner = keep.nonzero()[:, 0]
            greedy_tok = d_logits.argmax(-1)
            for j, r in enumerate(reqs):
                rows = (owner == j).nonzero().squeeze(1)
                i = spec[j]
                khat[i] = int(kh[j])
                if r.params.temperature == 0:
                    drafts_per[i] = greedy_tok[rows].tolist()
                elif rows.numel():
                    try:  # q is filtered exactly like p will be (lossless top-k / top-p)
                        p = self._dist(d_logits[rows], [r] * rows.numel())
                        drafts_per[i] = torch.multinomial(p, 1, generator=r.generator).squeeze(1).tolist()
                        probs_per[i] = p
                    except (RuntimeError, ValueError, FloatingPointError) as exc:
                        self._fail(r, f"drafting failed: {exc}")
                        khat[i], drafts_per[i] = 1, []
        verify_tokens = [[r.output_ids[-1], *drafts_per[i]] for i, r in enumerate(decoding)]
        drafts = torch.tensor([t for ds in drafts_per for t in ds], dtype=torch.long)
        d_probs = None
        if any(p is not None for p in probs_per):
            V = self.target.config.vocab_size
            dtype = next(p.dtype for p in probs_per if p is not None)
            d_probs = torch.cat(
                [
                    p if p is not None else torch.zeros(len(ds), V, dtype=dtype)
                    for p, ds in zip(probs_per, drafts_per, strict=True)
                ]
            )
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = torch.tensor(khat).cumsum(0)
        return self._Plan(verify_tokens, khat, a_hat, drafts, d_probs, cu)

    def _ngram_draft(self, r: Request, i: int, khat: list[int], drafts_per: list, probs_per: list) -> None:
        """Prompt-lookup drafts; when sampling, q is the point mass on each draft, so speculative
        sampling accepts x with prob p(x) and resamples the residual — still lossless."""
        k = self.block_size if self.bundle is not None else NGRAM_BLOCK
        room = min(k - 1, r.params.max_tokens - len(r.output_ids) - 1)
        draft = ngram_propose(r.prompt_ids + r.output_ids, room) if room > 0 else []
        khat[i], drafts_per[i] = len(draft) + 1, draft
        if draft and r.params.temperature > 0:
            q = torch.zeros(len(draft), self.target.config.vocab_size, dtype=self.model.dtype)
            q[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
            probs_per[i] = q

    def _verify(
        self, decoding: list[Request], plan: _Plan, t_logits: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        """Greedy requests by exact argmax matching, sampling requests by speculative sampling."""
        n = len(decoding)
        accepted = [0] * n
        nxt = [0] * n
        doff = kernels.draft_offsets(plan.cu)
        greedy = [i for i, r in enumerate(decoding) if r.params.temperature == 0]
        sampled = [i for i, r in enumerate(decoding) if r.params.temperature > 0]
        for group in (greedy, sampled):
            if not group:
                continue
            t_rows = torch.cat([torch.arange(int(plan.cu[i]), int(plan.cu[i + 1])) for i in group])
            d_rows = torch.cat([torch.arange(int(doff[i]), int(doff[i + 1])) for i in group])
            lens = torch.tensor([plan.khat[i] for i in group])
            cu = torch.zeros(len(group) + 1, dtype=torch.long)
            cu[1:] = lens.cumsum(0)
            drafts = plan.drafts[d_rows]
            if group is greedy:
                acc, nx = kernels.greedy_verify(drafts, t_logits[t_rows], cu)
            else:
                p = self._dist(t_logits[t_rows], [decoding[i] for i in group for _ in range(plan.khat[i])])
                bad = _bad_rows(p)
                if bool(bad.any()):  # fail those requests alone; give the kernel a valid row
                    for j, i in enumerate(group):
                        if bool(bad[int(cu[j]) : int(cu[j + 1])].any()):
                            self._fail(decoding[i], "the sampling distribution is not finite")
                    p[bad] = 1.0 / p.shape[-1]
                q = (
                    plan.d_probs[d_rows].to(p.dtype)
                    if plan.d_probs is not None
                    else p.new_zeros(0, p.shape[-1])
                )
                # Uniforms from each request's own generator: its output does not depend on who
                # else shares the step.
                u_acc = torch.cat(
                    [
                        torch.rand(plan.khat[i] - 1, generator=decoding[i].generator, dtype=p.dtype)
                        for i in group
                    ]
                )
                u_smp = torch.cat(
                    [torch.rand(1, generator=decoding[i].generator, dtype=p.dtype) for i in group]
                )
                acc, nx = kernels.sampling_verify(drafts, q, p, cu, u_acc, u_smp)
            for j, i in enumerate(group):
                accepted[i], nxt[i] = int(acc[j]), int(nx[j])
        return accepted, nxt

    @staticmethod
    def _dist(logits: torch.Tensor, owners: list[Request]) -> torch.Tensor:
        """Sampling distributions of rows owned by `owners` (one request per row): temperature,
        then that request's top-k / top-p."""
        temps = torch.tensor([r.params.temperature for r in owners], dtype=torch.float64)
        top_p = torch.tensor([r.params.top_p for r in owners], dtype=torch.float64)
        top_k = torch.tensor([r.params.top_k for r in owners], dtype=torch.long)
        return _probs(logits, temps, top_p, top_k)

    def _sample_first(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        out = logits.argmax(-1).tolist()
        for j, r in enumerate(reqs):
            if r.params.temperature > 0:
                try:
                    p = self._dist(logits[j : j + 1], [r])
                    if bool(_bad_rows(p).any()):
                        raise FloatingPointError("the sampling distribution is not finite")
                    out[j] = int(torch.multinomial(p, 1, generator=r.generator))
                except (RuntimeError, ValueError, FloatingPointError) as exc:
                    self._fail(r, f"sampling failed: {exc}")
        return out

    def _fail(self, r: Request, message: str, kind: str = "invalid") -> None:
        """Mark one request as failed; the step finishes it without touching the others."""
        if r.error is None:
            log.warning("request %s failed: %s", r.request_id, message)
            r.error, r.error_kind = message, kind
        r.finish_reason = "error"

    def _finish_failed(self, r: Request, now: float) -> None:
        r.status = Status.FINISHED
        r.finish_reason = "error"
        r.finish_time = now
        self._notify(r, [])

    def _notify(self, r: Request, new: list[int]) -> None:
        if r.sink is None:
            return
        try:
            r.sink(r, new, r.finished)
        except Exception:  # noqa: BLE001 - a broken client bridge must not stop the step loop
            log.exception("sink of request %s failed: cancelling it", r.request_id)
            if not r.finished:
                self.cancel(r.request_id)

    def _emit(self, r: Request, new: list[int], now: float) -> None:
        """Append new tokens, cut at the first eos / stop sequence / max_tokens, stream them."""
        for j, t in enumerate(new):
            if t in self.eos:
                new = new[: j + 1]
                r.finish_reason = "stop"
                break
        new = new[: r.params.max_tokens - len(r.output_ids)]
        before = len(r.output_ids)
        r.output_ids.extend(new)
        if r.params.stop:
            cut = self._stop_cut(r, before)
            if cut is not None:
                del r.output_ids[cut:]
                new = new[: cut - before]
                r.finish_reason = "stop"
        r.token_times.extend([now] * len(new))
        if r.finish_reason is None and len(r.output_ids) >= r.params.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            r.status = Status.FINISHED
            r.finish_time = now
        self._notify(r, new)

    def _stop_cut(self, r: Request, before: int) -> int | None:
        """Number of output tokens to keep when a stop sequence completes in the tokens after
        `before`: the shortest prefix whose text contains one (earlier checks found none). Sets
        `r.stop_index`, where the returned text ends (the stop sequence itself is not returned)."""
        tok = self.target.tokenizer
        for n in range(before + 1, len(r.output_ids) + 1):
            text = tok.decode([t for t in r.output_ids[:n] if t not in self.eos])
            hits = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
            if hits:
                r.stop_index = min(hits)
                return n
        return None

    def _release(self, r: Request) -> None:
        self.scheduler.finish(r, r.e2e)
        for obs in self.observers:
            try:
                obs(r)
            except Exception:  # noqa: BLE001 - metrics/feedback trouble must not stop serving
                log.exception("finish observer failed on request %s", r.request_id)

    def _reap_cancelled(self) -> None:
        with self._cancel_lock:
            ids, self._cancel = self._cancel, set()
        for rid in ids:
            r = self.scheduler.running.get(rid)
            if r is None:
                r = next((p for p in list(self.scheduler.pending) if p.request_id == rid), None)
                if r is None or not self.scheduler.remove_pending(r):
                    continue
            r.cancelled = True
            r.finish_reason = "cancelled"
            r.status = Status.FINISHED
            r.finish_time = time.perf_counter()
            self.scheduler.finish(r)  # frees the slot and its KV reservation now
            self._notify(r, [])

    # --- drafter (hot reload) ---------------------------------------------------------------------

    def _install(self, bundle: DrafterBundle | None, version: str | None) -> None:
        self.bundle = bundle
        self.drafter_version = version if bundle is not None else None
        self.dslots = (
            DrafterSlots(bundle.drafter, self.config.max_running, self.capacity)
            if bundle is not None
            else None
        )

    def _apply_staged(self) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        self._install(*staged)
        self.reloads += 1
        # The context cache belongs to the drafter (its fc and k/v projections): rebuild it for
        # in-flight requests from their committed tokens' target features. The target K/V
        # rewritten on the way are the same values at the same positions.
        live = [
            r
            for r in self.scheduler.running.values()
            if r.status is Status.RUNNING and r.kv_len > 0 and r.method in DRAFTER_METHODS
        ]
        if not live:
            return
        committed = [(r.prompt_ids + r.output_ids)[: r.kv_len] for r in live]
        batch = PackedBatch.build([Segment(r.slot, 0, toks) for r, toks in zip(live, committed, strict=True)])
        _, features = self.runner.forward(batch, tuple(self.bundle.config.target_layer_ids))
        self.dslots.extend(features, batch.slot_rows, batch.positions)
        for r in live:
            if r.method in DRAFTER_METHODS:
                r.drafter_version, r.block_size = self.drafter_version, self.block_size
