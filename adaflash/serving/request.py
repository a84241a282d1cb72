"""The request state object: what travels through the engine (vLLM's `Request`), and its params.

A request is created by the API layer, validated against what the engine can serve, and from
then on owned by the engine's step-loop thread: the scheduler places it, the proposer drafts for
it, the verifier commits tokens to it, `commit` cuts and streams them.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from adaflash.errors import InputError
from adaflash.models.ngram import NgramIndex
from adaflash.models.suffix import SuffixIndex

log = logging.getLogger(__name__)

# `ar`: plain decoding. `dflash`: the drafter's full block every round. `adaflash`: the paper's
# length head, k̂ = ⌊γ·â·k⌋. `adaflash-cost`: per request and round, the measured-cost policy picks
# the proposer (drafter, n-gram lookup, or none) and k̂ that promise the most tokens per second.
# `ngram`: prompt lookup alone (vLLM's `ngram`, SGLang's NGRAM). `suffix`: suffix decoding alone
# (the request's own text and its tenant's governed responses, `lookup.py`). All are lossless.
METHODS: tuple[str, ...] = ("ar", "dflash", "adaflash", "adaflash-cost", "ngram", "suffix")
LOOKUP_METHODS = ("ngram", "suffix")  # model-free: no drafter, the method names its proposer
DRAFTER_METHODS = ("dflash", "adaflash", "adaflash-cost")  # run the drafter, keep its context
HEAD_METHODS = ("adaflash", "adaflash-cost")  # need the length head

# Temperatures below this sample as greedy decoding (vLLM's _SAMPLING_EPS): logits / T overflows
# to inf for T ~ 1e-40, softmax turns into NaN and multinomial raises.
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed's range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Most alternatives per token a request may ask logprobs for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Streaming holds back any tail that could start a stop sequence, a check quadratic in the stop's
# length: the bound keeps a 100k-character "stop" from making every streamed token cost seconds.
MAX_STOP_CHARS = 512


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
    # None: no logprobs. k in [0, MAX_LOGPROBS]: each committed token's logprob and the k most
    # likely tokens at its position, under the target's distribution (see `TokenLogprob`).
    logprobs: int | None = None


@dataclass
class TokenLogprob:
    """One committed token's log-probability under the target's distribution at its position (the
    row verification compared the drafts with, so speculative decoding reports what plain decoding
    would), and the `top` most likely tokens there, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RoundStat:
    start: int  # output index of the round's anchor (feedback schema's convention)
    verify_len: int  # k̂, anchor included
    accepted: int  # drafted tokens accepted
    a_hat: float | None = None
    proposer: str = "drafter"  # "drafter" | "ngram" | "suffix" | "none" (an AR round)


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
    use_suffix_cache: bool = True  # False: no drafts from the tenant's suffix cache (A/B, header)
    use_prefix_cache: bool = True  # False: prefill the whole prompt, and keep none of it (A/B)
    sink: Sink | None = None
    # --- state, owned by the engine -------------------------------------------------------
    method: str = "ar"
    status: Status = Status.WAITING
    slot: int = -1
    kv_len: int = 0  # committed tokens in the target KV (and drafter context)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, if asked for
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
    # Per-request acceptance memory of the cost policy (EMA of accepted drafts per proposer).
    accept_ema: dict[str, float] = field(default_factory=dict)
    lookup: NgramIndex = field(default_factory=NgramIndex, repr=False)  # prompt lookup's n-gram table
    suffix_index: SuffixIndex | None = field(default=None, repr=False)  # suffix decoding's own index
    suffix_probs: list[float] = field(default_factory=list, repr=False)  # this round's draft estimate
    suffix_source: str = field(default="own", repr=False)  # "own" history or the "tenant" cache
    # The cost policy's estimate for this round's n-gram draft, before its reliability factor.
    ngram_probs: list[float] = field(default_factory=list, repr=False)

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

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fail(self, message: str, kind: str = "invalid") -> bool:
        """Mark this request failed (the first reason wins); True if it was not failed before."""
        first = self.error is None
        if first:
            log.warning("request %s failed: %s", self.request_id, message)
            self.error, self.error_kind = message, kind
        self.finish_reason = "error"
        return first

    def commit(
        self,
        new: list[int],
        eos: set[int],
        decode: Callable[[list[int]], str],
        now: float,
        logprobs: list[TokenLogprob] | None = None,
    ) -> list[int]:
        """Append verified tokens (and their `logprobs`, one per token), cut at the first eos /
        stop sequence / max_tokens; returns the tokens actually committed (what the client is
        sent)."""
        for j, t in enumerate(new):
            if t in eos:
                new = new[: j + 1]
                self.finish_reason = "stop"
                break
        new = new[: self.params.max_tokens - len(self.output_ids)]
        before = len(self.output_ids)
        self.output_ids.extend(new)
        if self.params.stop:
            cut = self._stop_cut(before, eos, decode)
            if cut is not None:
                del self.output_ids[cut:]
                new = new[: cut - before]
                self.finish_reason = "stop"
        if logprobs is not None:
            self.logprobs.extend(logprobs[: len(new)])
        self.token_times.extend([now] * len(new))
        if self.finish_reason is None and len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.finish(None, now)
        return new

    def _stop_cut(self, before: int, eos: set[int], decode: Callable[[list[int]], str]) -> int | None:
        """Number of output tokens to keep when a stop sequence completes in the tokens after
        `before`: the shortest prefix whose text contains one (earlier checks found none). Sets
        `stop_index`, where the returned text ends (the stop sequence itself is not returned)."""
        for n in range(before + 1, len(self.output_ids) + 1):
            text = decode([t for t in self.output_ids[:n] if t not in eos])
            hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            if hits:
                self.stop_index = min(hits)
                return n
        return None

    def finish(self, reason: str | None, now: float) -> None:
        if reason is not None:
            self.finish_reason = reason
        self.status = Status.FINISHED
        self.finish_time = now


def check_params(p: GenParams, method: str, has_drafter: bool, has_head: bool) -> None:
    """Raise InputError for a method or sampling parameters the engine cannot serve as given."""
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method in DRAFTER_METHODS and not has_drafter:
        raise InputError(f"method {method!r} needs a drafter; this server runs without one")
    if method in HEAD_METHODS and not has_head:
        raise InputError(f"method {method!r} needs a drafter with a length head")
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
    if any(len(x) > MAX_STOP_CHARS for x in p.stop):
        raise InputError(f"a stop sequence must be at most {MAX_STOP_CHARS} characters")
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise InputError("max_tokens must be >= 1")
    if p.logprobs is not None and not (isinstance(p.logprobs, int) and 0 <= p.logprobs <= MAX_LOGPROBS):
        raise InputError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")


def check_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    if not prompt_ids:
        raise InputError("empty prompt")
    if not all(isinstance(t, int) for t in prompt_ids):
        raise InputError("prompt token ids must be integers")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise InputError("prompt contains token ids outside the target vocabulary")
