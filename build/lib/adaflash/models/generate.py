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
    n = len(prompts)
    slots = min(slots, n)
    capacity = max(len(p) for p in prompts) + max_new_tokens + 1
    eos = set(eos_token_ids)
    results: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    queue = list(range(n))
    owner = [-1] * slots  # prompt index in each slot, -1 = free
    cache = model.new_cache(slots, capacity)
    nxt = torch.zeros(slots, dtype=torch.long)
    capture = tuple(capture_layers) if on_features is not None else ()
    feats: dict[int, list[torch.Tensor]] = {}

    def record(slot: int, tok: int) -> None:
        i = owner[slot]
        results[i].append(tok)
        if tok in eos or len(results[i]) >= max_new_tokens:
            finished[i] = True
            if capture:
                on_features(i, torch.cat(feats.pop(i)))
            if on_done is not None:
                on_done(i, results[i])
            owner[slot] = -1
            cache.lengths[slot] = 0  # a free slot computes garbage at position 0 until refilled

    def admit() -> None:
        free = [s for s in range(slots) if owner[s] < 0][: len(queue)]
        if not free:
            return
        take = [queue.pop(0) for _ in free]
        # Prefill in length-sorted chunks of <= prefill_tokens padded tokens: one padded batch of
        # 128 prompts of mixed length wastes most of its rows on padding (and gigabytes of cache).
        pairs = sorted(zip(free, take, strict=True), key=lambda st: len(prompts[st[1]]))
        while pairs:
            n = max(1, min(len(pairs), prefill_tokens // max(len(prompts[pairs[0][1]]), 1)))
            while n > 1 and n * len(prompts[pairs[n - 1][1]]) > prefill_tokens:
                n -= 1
            chunk, pairs = pairs[:n], pairs[n:]
            sub, first, f = _prefill(model, [prompts[i] for _, i in chunk], capacity, capture)
            if capture:
                for j, (_, i) in enumerate(chunk):
                    feats[i] = [f[j, : len(prompts[i])].to(torch.float16)]
            idx = torch.tensor([s for s, _ in chunk])
            cache.k[:, idx], cache.v[:, idx] = sub.k, sub.v
            cache.lengths[idx] = sub.lengths
            nxt[idx] = first
            for (s, i), tok in zip(chunk, first.tolist(), strict=True):
                owner[s] = i
                record(s, tok)  # the prefill's token is the first generated one

    while deadline is None or time.time() < deadline:
        n_free = sum(o < 0 for o in owner)
        if queue and (n_free == slots or n_free >= max(1, int(refill_fraction * slots))):
            admit()
        if all(o < 0 for o in owner):
            if not queue:
                break
            continue  # every admitted prompt finished at its first token: admit more
        out = model(nxt[:, None], cache, capture_layers=capture)
        # Only live slots advance; free ones stay at length 0 and cannot outgrow the cache.
        cache.commit(torch.tensor([o >= 0 for o in owner], dtype=torch.long))
        if capture:
            f16 = out.features[:, 0].to(torch.float16)
            for s in range(slots):
                if owner[s] >= 0:
                    feats[owner[s]].append(f16[s : s + 1])
        nxt = model.logits(out.hidden[:, -1]).argmax(-1)
        for s in range(slots):
            if owner[s] >= 0:
                record(s, int(nxt[s]))
    return [r if r or done else None for r, done in zip(results, finished, strict=True)]
