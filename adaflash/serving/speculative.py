"""Speculative decoding for a (padded) batch of requests: `ar`, `dflash` (fixed k), `adaflash` (k̂).

One round, for every live request at once:
  drafter block forward -> length head (adaflash) -> drafter logits for the k̂-1 kept positions
  only -> one target forward over [anchor, drafts] -> packed verification (greedy or speculative
  sampling) -> commit anchor + accepted drafts to both KV caches -> the bonus token is the next
  anchor.
`ar` runs the same loop with k̂ = 1 and no drafter, so the three methods are compared on one
engine. The packed continuous-batching engine (serving issue) reuses these pieces.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from adaflash import kernels
from adaflash.errors import InputError
from adaflash.models.checkpoint import DrafterBundle
from adaflash.models.generate import pad_batch
from adaflash.models.length_head import verify_lengths
from adaflash.models.targets import Target

Method = Literal["ar", "dflash", "adaflash"]
METHODS: tuple[str, ...] = ("ar", "dflash", "adaflash")


@dataclass(frozen=True)
class DecodeConfig:
    method: Method = "adaflash"
    max_new_tokens: int = 128
    temperature: float = 0.0
    gamma: float = 1.0
    seed: int = 0


@dataclass
class Round:
    verify_len: int  # k̂: block positions the target verified (anchor included)
    accepted: int  # drafted tokens accepted
    a_hat: float | None = None


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    finish_reason: str = "length"
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens gained per target forward (accepted drafts + the bonus token)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def mean_verify_len(self) -> float:
        return sum(r.verify_len for r in self.rounds) / max(len(self.rounds), 1)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (
        torch.softmax(logits.float() / temperature, dim=-1)
        if logits.dtype != torch.float64
        else torch.softmax(logits / temperature, dim=-1)
    )


class SpeculativeDecoder:
    def __init__(self, target: Target, drafter: DrafterBundle | None = None) -> None:
        self.target = target
        self.bundle = drafter

    def _validate(self, prompts: list[list[int]], cfg: DecodeConfig) -> None:
        if cfg.method not in METHODS:
            raise InputError(f"unknown method {cfg.method!r}: choose one of {', '.join(METHODS)}")
        if cfg.method != "ar" and self.bundle is None:
            raise InputError(f"method {cfg.method!r} needs a drafter (--drafter DIR)")
        if cfg.method == "adaflash" and self.bundle.length_head is None:
            raise InputError("method 'adaflash' needs a drafter with a length head")
        if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
            raise InputError(f"invalid temperature {cfg.temperature}: must be a finite number >= 0")
        if not cfg.gamma > 0:
            raise InputError(f"invalid gamma {cfg.gamma}: must be > 0")
        if cfg.max_new_tokens < 1:
            raise InputError("max_new_tokens must be >= 1")
        limit = self.target.max_context
        for p in prompts:
            if not p:
                raise InputError("empty prompt")
            if len(p) + cfg.max_new_tokens > limit:
                raise InputError(
                    f"prompt of {len(p)} tokens + max_new_tokens {cfg.max_new_tokens} exceeds the "
                    f"target's context window of {limit} tokens"
                )
            if max(p) >= self.target.config.vocab_size or min(p) < 0:
                raise InputError("prompt contains token ids outside the target vocabulary")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], cfg: DecodeConfig) -> list[GenerationResult]:
        self._validate(prompts, cfg)
        t0 = time.perf_counter()
        model = self.target.model
        use_drafter = cfg.method != "ar"
        drafter = self.bundle.drafter if use_drafter else None
        k = drafter.block_size if drafter else 1
        capture = tuple(drafter.config.target_layer_ids) if drafter else ()
        gen = torch.Generator().manual_seed(cfg.seed)
        greedy = cfg.temperature == 0
        eos = torch.tensor(list(self.target.tokenizer.eos_token_ids), dtype=torch.long)

        B = len(prompts)
        tokens, lengths = pad_batch(prompts)
        capacity = int(lengths.max()) + cfg.max_new_tokens + k + 1
        tcache = model.new_cache(B, capacity)
        ctx = drafter.new_context(B, capacity) if drafter else None
        out = model(tokens, tcache, capture_layers=capture)
        tcache.commit(lengths)
        if drafter:
            drafter.extend_context(ctx, out.features, lengths)
        last = model.logits(out.hidden[torch.arange(B), lengths - 1])
        anchor = (
            last.argmax(-1)
            if greedy
            else torch.multinomial(_probs(last, cfg.temperature), 1, generator=gen).squeeze(1)
        )

        results = [GenerationResult() for _ in range(B)]
        alive = torch.arange(B)
        pending = anchor  # newest token of each live request: emitted, not yet in the KV cache
        for b, t in enumerate(pending.tolist()):
            results[b].token_ids.append(t)
        finished = self._finished(results, alive, pending, eos, cfg.max_new_tokens)

        while True:
            keep = (~finished).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            if keep.numel() < alive.numel():
                alive, pending = alive[keep], pending[keep]
                tcache.k, tcache.v, tcache.lengths = (
                    tcache.k[:, keep],
                    tcache.v[:, keep],
                    tcache.lengths[keep],
                )
                if ctx is not None:
                    ctx.k = [x[keep] for x in ctx.k]
                    ctx.v = [x[keep] for x in ctx.v]
                    ctx.lengths = ctx.lengths[keep]
            n = alive.numel()
            remaining = torch.tensor([cfg.max_new_tokens - len(results[b].token_ids) for b in alive.tolist()])
            a_hat = None
            if drafter:
                block = torch.full((n, k), drafter.config.mask_token_id, dtype=torch.long)
                block[:, 0] = pending
                hidden = drafter.draft_hidden(ctx, model.embed(block))
                if cfg.method == "adaflash":
                    a_hat = self.bundle.length_head(hidden)
                    khat = verify_lengths(a_hat, k, cfg.gamma)
                else:
                    khat = torch.full((n,), k, dtype=torch.long)
                # A round yields at most k̂ tokens; never draft past max_new_tokens.
                khat = torch.minimum(khat, remaining)
                keep_rows = torch.arange(1, k)[None, :] < khat[:, None]  # [n, k-1]
                # Only the kept positions go through the 49k-wide LM head (its cost dominates).
                d_logits = model.logits(hidden[:, 1:][keep_rows])
                if greedy:
                    drafts, d_probs = d_logits.argmax(-1), None
                else:
                    d_probs = _probs(d_logits, cfg.temperature)
                    drafts = (
                        torch.multinomial(d_probs, 1, generator=gen).squeeze(1)
                        if d_probs.numel()
                        else d_logits.new_zeros(0, dtype=torch.long)
                    )
            else:
                khat = torch.ones(n, dtype=torch.long)
                keep_rows = torch.zeros(n, 0, dtype=torch.bool)
                drafts, d_probs = torch.zeros(0, dtype=torch.long), None

            width = int(khat.max())
            verify_tokens = torch.zeros(n, width, dtype=torch.long)
            verify_tokens[:, 0] = pending
            verify_tokens[:, 1:][keep_rows[:, : width - 1]] = drafts
            out = model(verify_tokens, tcache, capture_layers=capture)
            rows = torch.arange(width)[None, :] < khat[:, None]
            t_logits = model.logits(out.hidden[rows])
            cu = torch.zeros(n + 1, dtype=torch.long)
            cu[1:] = khat.cumsum(0)
            if greedy:
                accepted, nxt = kernels.greedy_verify(drafts, t_logits, cu)
            else:
                # Probabilities and uniforms in >= fp32: a bf16 target must not quantise acceptance.
                prec = torch.float64 if t_logits.dtype == torch.float64 else torch.float32
                u_accept = torch.rand(drafts.numel(), generator=gen, dtype=prec)
                u_sample = torch.rand(n, generator=gen, dtype=prec)
                p = _probs(t_logits.to(prec), cfg.temperature)
                d_probs = d_probs.to(prec) if d_probs is not None else None
                q = d_probs if d_probs is not None else p.new_zeros(0, p.shape[-1])
                accepted, nxt = kernels.sampling_verify(drafts, q, p, cu, u_accept, u_sample)

            tcache.commit(accepted + 1)  # the anchor and the accepted drafts are now context
            if drafter:
                drafter.extend_context(ctx, out.features, accepted + 1)
            d_off = kernels.draft_offsets(cu)
            for i, b in enumerate(alive.tolist()):
                acc = int(accepted[i])
                start = int(d_off[i])
                new = drafts[start : start + acc].tolist() + [int(nxt[i])]
                results[b].token_ids.extend(new)
                results[b].rounds.append(
                    Round(int(khat[i]), acc, float(a_hat[i]) if a_hat is not None else None)
                )
            pending = nxt
            finished = self._finished(results, alive, pending, eos, cfg.max_new_tokens)

        elapsed = time.perf_counter() - t0
        for r in results:
            r.seconds = elapsed
        return results

    @staticmethod
    def _finished(
        results: list[GenerationResult],
        alive: torch.Tensor,
        pending: torch.Tensor,
        eos: torch.Tensor,
        max_new: int,
    ) -> torch.Tensor:
        """Truncate at the first eos / max_new_tokens; a finished request leaves the batch."""
        done = torch.zeros(alive.numel(), dtype=torch.bool)
        for i, b in enumerate(alive.tolist()):
            r = results[b]
            hits = torch.isin(torch.tensor(r.token_ids), eos).nonzero()
            if hits.numel():
                r.token_ids = r.token_ids[: int(hits[0]) + 1]
                r.finish_reason = "stop"
                done[i] = True
            elif len(r.token_ids) >= max_new:
                r.token_ids = r.token_ids[:max_new]
                r.finish_reason = "length"
                done[i] = True
        return done
