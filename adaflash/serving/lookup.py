"""The model-free proposers: drafts that cost no forward, only the verify rows they add.

- `PromptLookupProposer` (`ngram`): the newest 1-3 tokens matched in the request's own prompt and
  output, the most recent continuation (vLLM `ngram`, SGLang NGRAM);
- `SuffixProposer` (`suffix`): SuffixDecoding — the request's own prompt and output *and* its
  tenant's earlier governed responses (`SuffixCache`), frequency-scored, the draft length
  adapting to the match.

Each answers `propose(request, room)` with at most `room` draft tokens (the `Proposer` interface
of `proposer.py`). The cost policy (`policy.py`) decides which one, if any, a round verifies and
how many of its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from adaflash.models.suffix import Draft, SuffixConfig, SuffixIndex
from adaflash.serving.request import Request
from adaflash.serving.suffix_cache import SuffixCache


class TokenView(Sequence[int]):
    """A prompt and its output as one read-only sequence, without copying either."""

    __slots__ = ("_head", "_tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self._head, self._tail = head, tail

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        h = len(self._head)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= h:
                return self._head[start:stop]
            if start >= h:
                return self._tail[start - h : stop - h]
            return self._head[start:] + self._tail[: stop - h]
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(i)
        return self._head[j] if j < h else self._tail[j - h]


def history(req: Request) -> list[int]:
    """The request's prompt and output as one list, kept by its prompt-lookup index and extended
    by the tokens committed since the last call: `req.tokens` would copy the whole history for
    every proposer at every priced step."""
    req.lookup.sync(TokenView(req.prompt_ids, req.output_ids))
    return req.lookup.seq


class PromptLookupProposer:
    name = "ngram"

    def propose(self, req: Request, room: int) -> list[int]:
        if room <= 0:
            return []
        history(req)
        return req.lookup.propose(room)


class SuffixProposer:
    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, config: SuffixConfig | None = None) -> None:
        self.cache = cache
        self.config = config or (cache.config.index if cache is not None else SuffixConfig())

    def _local(self, req: Request, tokens: Sequence[int]) -> SuffixIndex:
        """The request's own suffix index over its prompt and output, grown with every token."""
        idx = req.suffix_index
        if idx is None or idx.tokens > len(tokens):  # new, or cut by a stop sequence
            idx = req.suffix_index = SuffixIndex(self.config)
        if idx.tokens < len(tokens):
            idx.extend(0, tokens[idx.tokens :])
        return idx

    def draft(self, req: Request, room: int) -> Draft | None:
        """The better-scored of the request's own proposal and its tenant cache's."""
        if room <= 0:
            return None
        tokens = history(req)
        best = self._local(req, tokens).propose(tokens, room)
        req.suffix_source = "own"
        if self.cache is not None and self.cache.config.enabled and req.use_suffix_cache:
            shared = self.cache.propose(req.tenant_id, tokens, room)
            if shared is not None and (best is None or shared.score > best.score):
                best, req.suffix_source = shared, "tenant"
        return best

    def propose(self, req: Request, room: int) -> list[int]:
        d = self.draft(req, room)
        # The draft's own estimate (the matching occurrences' agreement) and where it came from
        # travel with the request: the cost policy prices this round's suffix draft by them
        # (`CostPolicy._lookup_survival`).
        req.suffix_probs = d.probs if d is not None else []
        return d.tokens if d is not None else []
