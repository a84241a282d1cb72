"""A record is scrubbed as one conversation, not as separate strings (issue 33):

  - a value found once is replaced everywhere it recurs in the record (prompt, history, output,
    and so in the re-tokenised ids): names part by part, every other kind as the literal value;
  - adjacent user turns are scanned joined, so a value cut across two turns is caught in both;
  - base64, hex, URL-encoded and HTML-entity runs are decoded and scanned; a run that hides
    personal data is replaced as a whole (the surrogate is re-encoded the same way).
Also the lineage view of a scrubbed text (`replaced_spans`): kinds and offsets, never values.
"""

from __future__ import annotations

import base64
import binascii
import html
import re
import urllib.parse

from adaflash.governance.pii_guard import overlaps
from adaflash.governance.pii_spans import Hit, ScrubResult, Span, merge_spans

_WORD_AT = re.compile(r"[^\W\d_][\w'’]*")
_MIN_VALUE = 4  # shorter literal values ("12") recur by chance


def propagate(texts: list[str], spans: list[list[Span]]) -> list[list[Span]]:
    """Every caught value recurs masked: each part of a Latin name as PERSON, any other value
    (a non-Latin name included) as the literal string with its kind."""
    from adaflash.governance.pii_names import name_like
    from adaflash.governance.pii_scripts import non_latin_name
    from adaflash.governance.pii_words import EXAMPLE_NAMES

    parts: set[str] = set()
    values: dict[str, str] = {}
    for text, sp in zip(texts, spans, strict=True):
        for s in sp:
            v = text[s.start : s.end].strip()
            if s.entity == "PERSON" and not non_latin_name(v):
                parts.update(
                    w
                    for w in _WORD_AT.findall(v)
                    if len(w) >= 3 and w[0].isupper() and w not in EXAMPLE_NAMES and name_like(w)
                )
            elif (len(v) >= _MIN_VALUE or len(v) >= 2 and not v.isascii()) and not s.entity.startswith(
                "ENCODED_"
            ):
                values.setdefault(v, s.entity)
    patterns = []
    if parts:
        alt = "|".join(re.escape(p) for p in sorted(parts, key=len, reverse=True))
        patterns.append((re.compile(r"(?<![\w])(?:" + alt + r")(?![\w])"), None))
    if values:
        alt = "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))
        patterns.append((re.compile(r"(?<![0-9A-Za-z])(?:" + alt + r")(?![0-9A-Za-z])"), values))
    if not patterns:
        return spans
    out = []
    for text, sp in zip(texts, spans, strict=True):
        extra = [
            Span(m.start(), m.end(), "PERSON" if kinds is None else kinds[m.group(0)])
            for rx, kinds in patterns
            for m in rx.finditer(text)
        ]
        out.append(merge_spans(sp + extra) if extra else sp)
    return out


# -- values cut across turns -------------------------------------------------------------------------
# A user turn: in the chat template's markers; as the decoded text shows them once the special
# tokens are dropped ("user\n...\nassistant\n"); or in a "User: ... Assistant:" transcript.
_USER_TURN = re.compile(
    r"<\|im_start\|>user\n(.*?)<\|im_end\|>"
    r"|(?:^|\n)user\n(.*?)(?=\nassistant\n|\Z)"
    r"|(?:^|\n)(?:User|Human|USER):[ \t]*(.*?)(?=\n(?:Assistant|AI|ASSISTANT):|\Z)",
    re.S,
)
_EDGE = 48


def split_turn_hits(text: str, rules) -> list[Span]:
    """Spans of values that only appear whole when adjacent user turns are read as one: the end
    of one user turn and the start of the next are joined and scanned with `rules(text) -> hits`;
    a hit across the join becomes a span in each turn."""
    turns = [next(m.span(g) for g in (1, 2, 3) if m.group(g) is not None) for m in _USER_TURN.finditer(text)]
    out: list[Span] = []
    for (a0, a1), (b0, b1) in zip(turns, turns[1:], strict=False):
        tail, head = text[max(a0, a1 - _EDGE) : a1].rstrip(), text[b0 : min(b1, b0 + _EDGE)].lstrip()
        if not tail or not head:
            continue
        t_end = a1 - (len(text[max(a0, a1 - _EDGE) : a1]) - len(tail))
        h_start = b0 + (len(text[b0 : min(b1, b0 + _EDGE)]) - len(head))
        for h in rules(tail + head):
            if h.start < len(tail) < h.end:
                out.append(Span(t_end - (len(tail) - h.start), t_end, h.entity))
                out.append(Span(h_start, h_start + (h.end - len(tail)), h.entity))
    return out


# -- encoded runs ----------------------------------------------------------------------------------------
_B64 = re.compile(r"(?<![A-Za-z0-9+/=_\-])[A-Za-z0-9+/]{16,4096}={0,2}(?![A-Za-z0-9+/=_\-])")
_HEX = re.compile(r"(?<![0-9A-Za-z])(?:[0-9A-Fa-f]{2}){8,2048}(?![0-9A-Za-z])")
_URLENC = re.compile(r"(?<![^\s\"'<>=(])[^\s\"'<>%]{0,200}(?:%[0-9A-Fa-f]{2}[^\s\"'<>%]{0,200}){2,400}")
_ENTITIES = re.compile(r"(?:&#[xX]?[0-9A-Fa-f]{1,7};[^\s&<>]{0,3}){4,1000}")


def _printable(s: str) -> bool:
    return bool(s) and sum(c.isprintable() or c in "\n\t" for c in s) >= 0.95 * len(s)


def decode(encoding: str, run: str) -> str | None:
    """The text an encoded run stands for, or None when it decodes to no readable text."""
    try:
        if encoding == "base64":
            raw = base64.b64decode(run + "=" * (-len(run) % 4), validate=True)
        elif encoding == "hex":
            raw = binascii.unhexlify(run)
        elif encoding == "url":
            return urllib.parse.unquote(run, errors="strict")
        else:
            return html.unescape(run)
        text = raw.decode("utf-8")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    return text if _printable(text) and any(c.isalnum() for c in text) else None


def encode(encoding: str, text: str, like: str) -> str:
    """`text` encoded as `like` was (hex case and base64 padding kept)."""
    if encoding == "base64":
        out = base64.b64encode(text.encode()).decode()
        return out if like.endswith("=") else out.rstrip("=")
    if encoding == "hex":
        out = text.encode().hex()
        return out.upper() if like.isupper() else out
    if encoding == "url":
        return urllib.parse.quote(text, safe="")
    return "".join(f"&#{ord(c)};" for c in text)


def encoding_of(run: str) -> str:
    if run.startswith("&#"):
        return "html"
    if "%" in run:
        return "url"
    if re.fullmatch(r"(?:[0-9A-Fa-f]{2})+", run):
        return "hex"
    return "base64"


def encoded_hits(text: str, regions: list, rules) -> list[Span]:
    """Encoded runs whose decoded text holds personal data, as `ENCODED_<KIND>` spans."""
    out = []
    for encoding, rx in (("hex", _HEX), ("base64", _B64), ("url", _URLENC), ("html", _ENTITIES)):
        for m in rx.finditer(text):
            if overlaps(m.start(), m.end(), regions) or any(
                s.start < m.end() and m.start() < s.end for s in out
            ):
                continue
            decoded = decode(encoding, m.group(0))
            if decoded is None or decoded == m.group(0):
                continue
            hits: list[Hit] = rules(decoded)
            if hits:
                out.append(Span(m.start(), m.end(), "ENCODED_" + hits[0].entity))
    return out


def replaced_spans(result: ScrubResult, where: str) -> list:
    """Lineage of one scrubbed text: kind and offsets (original and governed) of each replaced
    span, never its value."""
    from adaflash.feedback.schema import ReplacedSpan

    out, shift = [], 0
    for s in result.spans:
        new = len(s.replacement) if s.replacement is not None else len(s.entity) + 2
        out.append(
            ReplacedSpan(
                where=where,
                entity=s.entity,
                start=s.start,
                end=s.end,
                new_start=s.start + shift,
                new_end=s.start + shift + new,
            )
        )
        shift += new - (s.end - s.start)
    return out
