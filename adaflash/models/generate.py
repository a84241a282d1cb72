"""Batched greedy generation with the target alone (bootstrap data, reference outputs).

Continuous batching over a fixed number of slots: when a quarter of the slots have finished,
the next prompts are prefilled on their own and copied into the free slots. Finished slots keep
computing garbage until then (bounded waste) instead of shrinking the batch: on 2 CPU cores a
matmul with 32 rows runs at ~60 GFLOP/s and one with 128 rows at ~200, so a full batch is worth
more than the wasted rows cost, and no step copies the whole KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from adaflash.models.transformer import KVCache, TargetModel


def pad_batch(rows: Sequence[Sequence[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] tokens and per-row lengths, on the CPU (callers move them)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device="cpu")
    out = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=torch.long, device="cpu")
    return out, lengths


def _prefill(
    model: TargetModel, prompts: Sequence[Sequence[int]], capacity: int, capture: tuple[int, ...] = ()
) -> tuple[KVCache, torch.Tensor, torch.Tensor | None]:
    tokens, lengths = pad_batch(prompts)
    cache = model.new_cache(len(prompts), capacity)
    out = model(tokens, cache, capture_layers=capture)
    cache.commit(lengths)
    first = model.logits(out.hidden[torch.arange(len(prompts)), lengths - 1]).argmax(-1)
    return cache, first, out.features


class _Slots:
    """One `greedy_generate` call's state: which prompt each slot serves (-1: free), what every
    prompt has generated, the shared KV cache and the next token of each slot."""

    def __init__(
        self,
        model: TargetModel,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos: set[int],
        slots: int,
        capture: tuple[int, ...],
        on_done: Callable[[int, list[int]], None] | None,
        on_features: Callable[[int, torch.Tensor], None] | None,
    ) -> None:
        self.model, self.prompts, self.max_new_tokens, self.eos = model, prompts, max_new_tokens, eos
        self.slots, self.capture, self.on_done, self.on_features = slots, capture, on_done, on_features
        self.capacity = max(len(p) for p in prompts) + max_new_tokens + 1
        self.results: list[list[int]] = [[] for _ in prompts]
        self.finished = [False] * len(prompts)
        self.queue = list(range(len(prompts)))
        self.owner = [-1] * slots
        self.cache = model.new_cache(slots, self.capacity)
        self.nxt = torch.zeros(slots, dtype=torch.long)
        self.feats: dict[int, list[torch.Tensor]] = {}

    @property
    def free(self) -> int:
        return sum(o < 0 for o in self.owner)

    def record(self, slot: int, tok: int) -> None:
        i = self.owner[slot]
        self.results[i].append(tok)
        if tok in self.eos or len(self.results[i]) >= self.max_new_tokens:
            self.finished[i] = True
            if self.capture:
                self.on_features(i, torch.cat(self.feats.pop(i)))
            if self.on_done is not None:
                self.on_done(i, self.results[i])
            self.owner[slot] = -1
            self.cache.lengths[slot] = 0  # a free slot computes garbage at position 0 until refilled

    def admit(self, prefill_tokens: int) -> None:
        """Queued prompts into the free slots, prefilled in length-sorted chunks of at most
        `prefill_tokens` padded tokens: one padded batch of 128 prompts of mixed length wastes
        most of its rows on padding (and gigabytes of cache)."""
        free = [s for s in range(self.slots) if self.owner[s] < 0][: len(self.queue)]
        if not free:
            return
        take = [self.queue.pop(0) for _ in free]
        prompts = self.prompts
        pairs = sorted(zip(free, take, strict=True), key=lambda st: len(prompts[st[1]]))
        while pairs:
            n = max(1, min(len(pairs), prefill_tokens // max(len(prompts[pairs[0][1]]), 1)))
            while n > 1 and n * len(prompts[pairs[n - 1][1]]) > prefill_tokens:
                n -= 1
            chunk, pairs = pairs[:n], pairs[n:]
            self._prefill(chunk)

    def _prefill(self, chunk: list[tuple[int, int]]) -> None:
        """Prefill (slot, prompt index) pairs on their own cache and copy it into their slots."""
        sub, first, f = _prefill(self.model, [self.prompts[i] for _, i in chunk], self.capacity, self.capture)
        if self.capture:
            for j, (_, i) in enumerate(chunk):
                self.feats[i] = [f[j, : len(self.prompts[i])].to(torch.float16)]
        idx = torch.tensor([s for s, _ in chunk])
        self.cache.k[:, idx], self.cache.v[:, idx] = sub.k, sub.v
        self.cache.lengths[idx] = sub.lengths
        self.nxt[idx] = first
        for (s, i), tok in zip(chunk, first.tolist(), strict=True):
            self.owner[s] = i
            self.record(s, tok)  # the prefill's token is the first generated one

    def decode(self) -> None:
        """One greedy token for every slot; only live slots advance and record it."""
        owner = self.owner
        out = self.model(self.nxt[:, None], self.cache, capture_layers=self.capture)
        # Free slots stay at length 0 and cannot outgrow the cache.
        self.cache.commit(torch.tensor([o >= 0 for o in owner], dtype=torch.long))
        if self.capture:
            f16 = out.features[:, 0].to(torch.float16)
            for s in range(self.slots):
                if owner[s] >= 0:
                    self.feats[owner[s]].append(f16[s : s + 1])
        self.nxt = self.model.logits(out.hidden[:, -1]).argmax(-1)
        for s in range(self.slots):
            if owner[s] >= 0:
                self.record(s, int(self.nxt[s]))


@torch.no_grad()
def greedy_generate(
    model: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    slots: int = 128,
    refill_fraction: float = 0.25,
    on_done: Callable[[int, list[int]], None] | None = None,
    deadline: float | None = None,
    prefill_tokens: int = 4096,
    capture_layers: tuple[int, ...] = (),
    on_features: Callable[[int, torch.Tensor], None] | None = None,
) -> list[list[int] | None]:
    """Greedy continuations (eos included when produced) for each prompt, in input order.

    `on_done(i, tokens)` is called as each prompt finishes (so callers can persist results
    incrementally). At `deadline` (a time.time() value) generation stops: prompts never started
    are returned as None, prompts in flight as the prefix generated so far (check `on_done`
    to tell finished from cut).

    With `capture_layers`, `on_features(i, feats)` is called just before `on_done` with the
    captured layer outputs (fp16) of every token the target was fed for that prompt: rows
    0 .. L-2 of the L = prompt + response tokens (the last token is never fed). The drafter's
    features then cost no second target pass.
    """
    slots = min(slots, len(prompts))
    capture = tuple(capture_layers) if on_features is not None else ()
    gen = _Slots(model, prompts, max_new_tokens, set(eos_token_ids), slots, capture, on_done, on_features)
    while deadline is None or time.time() < deadline:
        n_free = gen.free
        if gen.queue and (n_free == slots or n_free >= max(1, int(refill_fraction * slots))):
            gen.admit(prefill_tokens)
        if gen.free == slots:
            if not gen.queue:
                break
            continue  # every admitted prompt finished at its first token: admit more
        gen.decode()
    return [r if r or done else None for r, done in zip(gen.results, gen.finished, strict=True)]
