"""The spans the PII layers agree on: a detection in original-text coordinates (`Span`), the
rules' hits and doubts (`Hit`, `SecondPass`), a scrubbed text (`ScrubResult`), and merging,
replacing and shifting spans — shared by the scrubber and the re-tokeniser."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from dataclasses import replace as _replace


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    entity: str
    replacement: str | None = None  # None: a `<ENTITY>` placeholder


@dataclass
class ScrubResult:
    text: str
    spans: list[Span]  # replaced spans, in original-text coordinates, sorted, non-overlapping
    unsure: list[str] = field(default_factory=list)  # second-pass doubts (kinds, never values)
    masked: str = ""  # the text with `<ENTITY>` placeholders: what similarity filters compare

    def __post_init__(self) -> None:
        if not self.masked:
            self.masked = self.text

    @property
    def counts(self) -> Counter:
        return Counter(s.entity for s in self.spans)


def merge_spans(spans: list[Span]) -> list[Span]:
    """Union overlapping detections; the merged span keeps the type of its longest member."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.start, -(s.end - s.start))):
        if out and s.start < out[-1].end:
            last = out[-1]
            longest = last if (last.end - last.start) >= (s.end - s.start) else s
            out[-1] = Span(last.start, max(last.end, s.end), longest.entity)
        else:
            out.append(s)
    return out


def replace_spans(text: str, spans: list[Span]) -> str:
    parts, pos = [], 0
    for s in spans:
        parts += [text[pos : s.start], s.replacement if s.replacement is not None else f"<{s.entity}>"]
        pos = s.end
    parts.append(text[pos:])
    return "".join(parts)


def shift_span(s: Span, offset: int, lo: int, hi: int) -> Span:
    """`s` clipped to [lo, hi) and moved by -offset, keeping its replacement."""
    return _replace(s, start=max(s.start, lo) - offset, end=min(s.end, hi) - offset)


@dataclass(frozen=True)
class Hit:
    start: int
    end: int
    entity: str
    cue: bool = True  # False: a name found by the name lists alone (a place veto applies)
    # True: its rule already judged it a name; the capitalisation-based filters do not apply (a
    # name typed in lower case or in capitals after a cue).
    judged: bool = False


@dataclass
class SecondPass:
    hits: list[Hit]
    unsure: list[str]  # why the pass could not decide (kinds only, never values)
