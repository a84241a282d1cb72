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
