"""The engine's configuration, and the statistics of one step that it hands to step observers."""

from __future__ import annotations

from dataclasses import dataclass, field

from adaflash.serving.prefix_cache import PrefixCacheConfig
from adaflash.serving.suffix_cache import SuffixCacheConfig

LOCKSTEP_MIN_PROB = 0.0


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
    # probe_every − 1 rounds of that request skip the drafter and run as plain AR rounds.
    # 1 = draft every round (the method as published).
    probe_every: int = 1
    # `adaflash-cost` with no request waiting: when the priced lockstep plan drafts nothing, the
    # batch's longest requests still verify their model-free drafts estimated at >= this
    # probability (`lockstep.confident`). 0: off.
    lockstep_min_prob: float = LOCKSTEP_MIN_PROB
    # Time a few forwards at start-up to seed `adaflash-cost`'s cost curves when a drafter with a
    # length head is installed (they also learn from every step); off: the curves start from the
    # first steps' measurements.
    calibrate: bool = True
    # The fast learner: per-tenant suffix indexes over governed responses (`suffix_cache.py`),
    # proposed from by `suffix` and `adaflash-cost`. Empty until a clean-topic feed fills it.
    suffix: SuffixCacheConfig = field(default_factory=SuffixCacheConfig)
    # The other fast learner: per-tenant target K/V of earlier prompts' heads, reused by every
    # method (`prefix_cache.py`); lossless, in memory only.
    prefix: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)


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
    proposers: list[str] = field(default_factory=list)  # per decoding request
