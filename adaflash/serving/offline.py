"""Offline generation: a list of prompts in, one result per prompt out, on the serving engine.

There is one decoding path: `adaflash generate`, `adaflash compare` and the tests submit their
prompts to an `Engine` and drive its step loop on the calling thread, with no decoder of their
own (a padded batch would re-implement drafting, sampling and validation beside the engine's), so
what they measure is what the server serves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.targets import Target
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.request import METHODS, GenParams, Request, RoundStat

__all__ = ["METHODS", "DecodeConfig", "GenerationResult", "OfflineDecoder"]


@dataclass(frozen=True)
class DecodeConfig:
    method: str = "adaflash"
    max_new_tokens: int = 128
    temperature: float = 0.0
    gamma: float = 1.0
    seed: int = 0  # prompt i samples with seed + i (distinct, reproducible streams)


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    rounds: list[RoundStat] = field(default_factory=list)
    finish_reason: str = "length"
    seconds: float = 0.0  # wall time of the whole call (the prompts ran as one batch)

    @property
    def tau(self) -> float:
        """Mean tokens gained per target forward (accepted drafts + the bonus token)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def mean_verify_len(self) -> float:
        return sum(r.verify_len for r in self.rounds) / max(len(self.rounds), 1)


class OfflineDecoder:
    """Batch generation for `target` (+ `drafter`): at most `max_running` prompts decode at once,
    the rest wait in the engine's queue."""

    def __init__(self, target: Target, drafter: DrafterBundle | None = None, max_running: int = 64) -> None:
        self.target = target
        self.bundle = drafter
        self.max_running = max_running

    def generate(self, prompts: list[list[int]], cfg: DecodeConfig) -> list[GenerationResult]:
        """Raises InputError (before anything runs) for a prompt or setting the engine refuses."""
        t0 = time.perf_counter()
        block = self.bundle.drafter.block_size if self.bundle is not None else 1
        longest = max((len(p) for p in prompts), default=0)
        engine = Engine(
            self.target,
            self.bundle,
            EngineConfig(
                method=cfg.method,
                gamma=cfg.gamma,
                max_running=max(1, min(self.max_running, len(prompts))),
                max_queue=max(1, len(prompts)),
                # Room for the longest prompt, its tokens and one round's block past the end.
                max_model_len=longest + cfg.max_new_tokens + block + 1,
                step_token_budget=max(1024, longest + 1),
                calibrate=cfg.method == "adaflash-cost",  # the only reader of the cost curves
            ),
        )
        reqs = [Request(list(p)) for p in prompts]
        for i, r in enumerate(reqs):  # validate every prompt before submitting any
            r.params = GenParams(cfg.max_new_tokens, cfg.temperature, cfg.seed + i, cfg.method)
            engine.validate(r)
        for r in reqs:
            engine.submit(r)
        engine.run_until_idle()
        seconds = time.perf_counter() - t0
        return [GenerationResult(r.output_ids, r.rounds, r.finish_reason or "length", seconds) for r in reqs]
