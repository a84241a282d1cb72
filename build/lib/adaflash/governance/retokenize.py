"""Replace scrubbed character spans in a token sequence without disturbing the rest of it.

Re-encoding a whole scrubbed text would shift or re-segment tokens far from any PII and break the
alignment between tokens and the served rounds. Instead only the tokens that overlap a scrubbed
span are re-encoded (widened to whole UTF-8 characters); every other token keeps its id, and the
returned index map says where each old token went (None: it was inside a rewritten region).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from adaflash.governance.pii_spans import Span, replace_spans, shift_span
from adaflash.models.tokenizer import Tokenizer


@dataclass
class Retokenized:
    token_ids: list[int]
    index_map: list[int | None]  # old token index -> new index, None if rewritten


def _is_continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def scrub_token_ids(ids: list[int], text: str, spans: list[Span], tokenizer: Tokenizer) -> Retokenized:
    """`text` must equal `tokenizer.decode(ids)`; `spans` are sorted, non-overlapping char spans."""
    if not spans:
        return Retokenized(list(ids), list(range(len(ids))))
    pieces = tokenizer.token_bytes(ids)
    data = b"".join(pieces)
    try:
        exact = data.decode("utf-8") == text
    except UnicodeDecodeError:  # e.g. an output cut inside a multi-byte character
        exact = False
    if not exact:
        # Offsets are unreliable: re-encode everything; no old token survives, so no round does.
        return Retokenized(tokenizer.encode(replace_spans(text, spans)), [None] * len(ids))
    tok_off = [0]
    for p in pieces:
        tok_off.append(tok_off[-1] + len(p))
    char_off = [0]  # char index -> byte offset
    for ch in text:
        char_off.append(char_off[-1] + len(ch.encode()))

    # Token index ranges [i0, i1) that overlap a span, merged, widened to character boundaries.
    regions: list[list[int]] = []
    for s in spans:
        b0, b1 = char_off[s.start], char_off[s.end]
        i0 = bisect_right(tok_off, b0) - 1
        i1 = i0
        while i1 < len(ids) and tok_off[i1] < b1:
            i1 += 1
        while i0 > 0 and tok_off[i0] < len(data) and _is_continuation(data[tok_off[i0]]):
            i0 -= 1
        while i1 < len(ids) and tok_off[i1] < len(data) and _is_continuation(data[tok_off[i1]]):
            i1 += 1
        if regions and i0 <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], i1)
        else:
            regions.append([i0, i1])

    byte_to_char = {b: c for c, b in enumerate(char_off)}
    new_ids: list[int] = []
    index_map: list[int | None] = []
    pos = 0
    for i0, i1 in regions:
        new_ids.extend(ids[pos:i0])
        index_map.extend(range(len(new_ids) - (i0 - pos), len(new_ids)))
        c0, c1 = byte_to_char[tok_off[i0]], byte_to_char[tok_off[i1]]
        local = [shift_span(s, c0, c0, c1) for s in spans if s.start < c1 and s.end > c0]
        new_ids.extend(tokenizer.encode(replace_spans(text[c0:c1], local)))
        index_map.extend([None] * (i1 - i0))
        pos = i1
    new_ids.extend(ids[pos:])
    index_map.extend(range(len(new_ids) - (len(ids) - pos), len(new_ids)))
    return Retokenized(new_ids, index_map)
