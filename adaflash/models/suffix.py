"""Suffix decoding's proposal (SuffixDecoding, arXiv 2411.04975; ArcticInference, vLLM `suffix`):
match the newest tokens against earlier token sequences, then follow the continuation that the
matching occurrences agree on most, one token at a time, while its frequency-estimated
probability stays above `min_prob`; speculate at most `spec_factor` × the match length.

The paper keeps a suffix tree of depth D over every sequence. A node per (suffix, depth) costs
~D nodes per stored token (a Python dict each: 24 × ~200 B for D = 24), too much for a cache of
10^5–10^6 tokens per tenant. This index keeps the same information in one entry per stored token:
every `key`-gram points at the positions it ended at; a lookup takes the occurrences of the
context's last `key` tokens, extends each match backwards (up to `max_depth`) and keeps the
longest matches — exactly the occurrences below the deepest matching node of the paper's tree,
whose counts are what the tree stores. The walk down from that node (most frequent child, its
share of the node's count as the conditional probability) is then done over those occurrences.

Pure Python on token ids; used per tenant over governed responses and per request over its
prompt and output (`adaflash/serving/lookup.py`).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

_POS_BITS = 24  # an index entry is sequence id << 24 | end position: one int, not a tuple
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass(frozen=True)
class SuffixConfig:
    key: int = 3  # shortest match that proposes (and the index's n-gram length)
    max_depth: int = 32  # longest match measured (the paper's tree depth)
    spec_factor: float = 1.0  # at most spec_factor × match length drafts (the paper's α)
    spec_offset: int = 0
    min_prob: float = 0.1  # stop when the draft's estimated probability falls below this
    scan: int = 64  # newest occurrences of the key examined per lookup (bounds a lookup's cost)


@dataclass
class Draft:
    tokens: list[int]
    probs: list[float]  # estimated P(the first j+1 drafts are all accepted), j = 0..
    match: int  # tokens of context the proposal matched
    support: int  # occurrences it was built from
    sources: list[int] = field(default_factory=list)  # sequence ids it came from (LRU touches)

    @property
    def score(self) -> float:
        """Expected accepted drafts, by the draft's own estimate."""
        return sum(self.probs)


class SuffixIndex:
    """Token sequences (added whole or grown token by token) and their key-gram index."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._seqs: dict[int, array] = {}
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._entries = 0  # index entries, live or pointing at a removed sequence
        self.tokens = 0  # tokens in live sequences

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, sid: int) -> bool:
        return sid in self._seqs

    @property
    def entries(self) -> int:
        return self._entries

    def sequence(self, sid: int) -> list[int]:
        return list(self._seqs[sid])

    def add(self, sid: int, tokens: Sequence[int]) -> None:
        """A new sequence (a replaced id is removed first)."""
        if sid in self._seqs:
            self.remove(sid)
        self._seqs[sid] = array("l")
        self.extend(sid, tokens)

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (created if new), indexing every key-gram they complete."""
        seq = self._seqs.setdefault(sid, array("l"))
        k = self.config.key
        start = len(seq)
        if start + len(tokens) > _POS_MASK:
            raise ValueError(f"a sequence is limited to {_POS_MASK} tokens")
        seq.extend(tokens)
        base = sid << _POS_BITS
        for end in range(max(start, k - 1), len(seq)):
            # The entry stores the position after the gram: where its continuation starts.
            self._index.setdefault(tuple(seq[end - k + 1 : end + 1]), []).append(base | (end + 1))
        added = max(0, len(seq) - max(start, k - 1))
        self._entries += added
        self.tokens += len(tokens)

    def remove(self, sid: int) -> None:
        """Forget a sequence. Its index entries go lazily: skipped by lookups, dropped when dead
        entries outnumber live ones (`compact`), so a removal costs nothing per gram."""
        seq = self._seqs.pop(sid, None)
        if seq is None:
            return
        self.tokens -= len(seq)
        if self._entries > 2 * self.tokens + 1024:
            self.compact()

    def compact(self) -> None:
        live = self._seqs
        index: dict[tuple[int, ...], list[int]] = {}
        entries = 0
        for gram, occ in self._index.items():
            kept = [e for e in occ if (e >> _POS_BITS) in live]
            if kept:
                index[gram] = kept
                entries += len(kept)
        self._index, self._entries = index, entries

    def propose(self, context: Sequence[int], limit: int) -> Draft | None:
        """Up to `limit` drafts to follow `context` (None: no occurrence of its last key tokens
        with a continuation)."""
        c = self.config
        k = c.key
        if limit <= 0 or len(context) < k:
            return None
        occ = self._index.get(tuple(context[-k:]))
        if not occ:
            return None
        matches: list[tuple[int, array, int, int]] = []  # (match length, seq, continuation, sid)
        depth = min(c.max_depth, len(context))
        for entry in reversed(occ):  # newest first
            sid, pos = entry >> _POS_BITS, entry & _POS_MASK
            seq = self._seqs.get(sid)
            if seq is None or pos >= len(seq):  # removed, or the gram ends its sequence
                continue
            m = k
            while m < depth and pos - 1 - m >= 0 and seq[pos - 1 - m] == context[-1 - m]:
                m += 1
            matches.append((m, seq, pos, sid))
            if len(matches) >= c.scan:
                break
        if not matches:
            return None
        match = max(m for m, *_ in matches)
        group = [(seq, pos, sid) for m, seq, pos, sid in matches if m == match]
        support = len(group)
        room = min(limit, int(c.spec_factor * match) + c.spec_offset)
        tokens: list[int] = []
        probs: list[float] = []
        p = 1.0
        for j in range(room):
            nxt = Counter(seq[pos + j] for seq, pos, _ in group if pos + j < len(seq))
            if not nxt:
                break
            tok, n = nxt.most_common(1)[0]
            p *= n / len(group)  # occurrences that end here count against every continuation
            if p < c.min_prob:
                break
            tokens.append(tok)
            probs.append(p)
            group = [(seq, pos, sid) for seq, pos, sid in group if pos + j < len(seq) and seq[pos + j] == tok]
        if not tokens:
            return None
        return Draft(tokens, probs, match, support, sorted({sid for *_, sid in group}))
