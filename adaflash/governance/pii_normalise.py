"""The text the PII layers read: what a human sees, not the code points a client typed.

Personal data hides from regexes and NER behind characters that change nothing on screen:
digits split by a no-break or thin space (`+33 6 12 34 56 78` with U+202F), a soft hyphen or a
zero-width space inside a card number or an e-mail, fullwidth digits (`０６１２３４５６７８`),
Unicode dashes, or JSON escapes in tool arguments (`"email": "ana\\u0040mail.com"`). The layers
run on a normalised copy instead, and every span they find maps back to the exact characters of
the original text, which is what gets replaced; the original is never rewritten wholesale (a
record keeps its own spelling wherever nothing personal was found).

Rules, per character: format characters (Unicode category Cf: soft hyphen, zero-width space and
joiners, word joiner, bidi marks, BOM) are dropped; every space separator (Zs) reads as a space;
dashes (Pd, the minus sign) read as `-`; a character whose NFKC form is one ASCII character
(fullwidth digits, letters and punctuation, superscript digits aside) reads as that; a `\\uXXXX`
escape reads as the character it encodes, under the same rules. Everything else is itself.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from adaflash.governance.pii_spans import Span

# What may need rewriting: a JSON \\u escape or any non-ASCII character.
_SPECIAL = re.compile(r"\\u[0-9a-fA-F]{4}|[^\x00-\x7f]")
_MINUS = "\u2212"


def _reads_as(c: str) -> str:
    """What one character reads as to the detectors ("" when it is invisible)."""
    if c.isascii():
        return c
    cat = unicodedata.category(c)
    if cat == "Cf":
        return ""
    if cat == "Zs":
        return " "
    if cat == "Pd" or c == _MINUS:
        return "-"
    if cat == "No":  # superscripts and fractions ("x²") keep their meaning as they are
        return c
    n = unicodedata.normalize("NFKC", c)
    return n if len(n) == 1 and n.isascii() else c


def _escape_reads_as(esc: str) -> str:
    c = chr(int(esc[2:], 16))
    if 0xD800 <= ord(c) <= 0xDFFF:  # half of a surrogate pair: leave the escape as typed
        return esc
    return _reads_as(c)


@dataclass(frozen=True)
class Normalised:
    """A normalised text and, when it differs from the original, where each of its characters
    came from (`starts[i]`, `ends[i]`: the original slice that reads as character i)."""

    text: str
    starts: list[int] | None = None
    ends: list[int] | None = None

    def original(self, span: Span) -> Span:
        """`span` (offsets in the normalised text) in the original text's offsets."""
        if self.starts is None or self.ends is None or span.end <= span.start:
            return span
        return Span(self.starts[span.start], self.ends[span.end - 1], span.entity, span.replacement)


def normalise(text: str) -> Normalised:
    """`text` as the PII layers should read it; identity (no offset map) when nothing changes."""
    if _SPECIAL.search(text) is None:
        return Normalised(text)
    pieces: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    prev, changed = 0, False
    for m in _SPECIAL.finditer(text):
        raw = m.group(0)
        new = _escape_reads_as(raw) if len(raw) > 1 else _reads_as(raw)
        if new == raw:
            continue
        changed = True
        a, b = m.span()
        pieces.append(text[prev:a])
        starts.extend(range(prev, a))
        ends.extend(range(prev + 1, a + 1))
        pieces.append(new)
        starts.extend([a] * len(new))
        ends.extend([b] * len(new))
        prev = b
    if not changed:
        return Normalised(text)
    pieces.append(text[prev:])
    starts.extend(range(prev, len(text)))
    ends.extend(range(prev + 1, len(text) + 1))
    return Normalised("".join(pieces), starts, ends)
