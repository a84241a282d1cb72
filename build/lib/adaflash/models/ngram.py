"""Prompt-lookup drafting (the model-free n-gram baseline of vLLM's `ngram` and SGLang's NGRAM
proposers): match the newest n tokens (n = max_n .. min_n) against the prompt and the output so
far, and propose the tokens that followed their most recent earlier occurrence."""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], count: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to `count` draft tokens to follow `tokens` (empty when no n-gram recurs)."""
    L = len(tokens)
    if count <= 0 or L < 2:
        return []
    seq = list(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = seq[L - n :]
        # Most recent earlier occurrence whose continuation is non-empty.
        for start in range(L - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                follow = seq[start + n : start + n + count]
                if follow:
                    return follow
    return []


class NgramIndex:
    """`propose` in O(max_n) per new token instead of a backwards scan per step: for each n-gram
    the position it last ended at. A request decoding 600 tokens with a 300-token prompt would
    otherwise rescan its whole history every round (measured: ~0.3 ms per request per step in
    Python, 10 ms per step at 32 requests — a tenth of a batch-32 decode step).

    Proposals are exactly `propose(tokens, count, max_n, min_n)`'s (property test): the newest
    n-gram's previous occurrence is what the table held just before the newest one replaced it.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.seq: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence
        self._prev: list[int | None] = []  # per n (index n - min_n): the tail's earlier end, if any

    def sync(self, tokens: Sequence[int]) -> None:
        """Index the tokens appended since the last call (`tokens` extends what was indexed)."""
        if len(tokens) < len(self.seq):  # cut (a stop sequence): index again from scratch
            self.seq, self._last, self._prev = [], {}, []
        seq, last = self.seq, self._last
        for i in range(len(seq), len(tokens)):
            seq.append(tokens[i])
            prev: list[int | None] = []
            for n in range(self.min_n, self.max_n + 1):
                if i - n + 1 < 0:
                    prev.append(None)
                    continue
                key = tuple(seq[i - n + 1 : i + 1])
                prev.append(last.get(key))
                last[key] = i
            self._prev = prev

    def propose(self, count: int) -> list[int]:
        """Up to `count` drafts after the indexed tokens (see `propose`)."""
        L = len(self.seq)
        if count <= 0 or L < 2:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = self._prev[n - self.min_n]
            if end is not None:
                return self.seq[end + 1 : end + 1 + count]
        return []
