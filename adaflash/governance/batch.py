"""The records one governance batch moves through: the consumed `Message`, what `_parse` and
`_scrub` made of it and the `BatchOutcome` (`governor.py` runs them; `config.py` configures it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from adaflash.feedback.schema import CleanRecord, FeedbackRecord, QuarantineRecord
from adaflash.governance.lineage import RecordRow


@dataclass(frozen=True)
class Message:
    """One consumed Kafka message (or a test's stand-in for one)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class BatchOutcome:
    clean: list[CleanRecord] = field(default_factory=list)
    quarantined: list[QuarantineRecord] = field(default_factory=list)
    rows: list[RecordRow] = field(default_factory=list)
    n_in: int = 0
    n_duplicate: int = 0
    pii: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    offsets: dict[str, list[int]] = field(default_factory=dict)
    clean_ids: set[str] = field(default_factory=set)  # a second clean record of an id is a duplicate
    timings: Counter = field(default_factory=Counter)  # stage -> seconds (benchmark profile)


@dataclass
class ParsedBatch:
    """What `_parse` made of a batch's new messages."""

    parsed: list[tuple[Message, FeedbackRecord]] = field(default_factory=list)
    failed: list[tuple[Message, str, str]] = field(default_factory=list)  # did not parse: code, detail
    unread: list[tuple[Message, str, str]] = field(default_factory=list)  # over a cap: never read


@dataclass
class ScrubbedBatch:
    """`_scrub`'s results, None where the scrubber raised on a text."""

    records: list[tuple[Any, Any]]  # (prompt, output) of each parsed record
    raw: list[tuple[Any, list]]  # (parsed JSON or text, results for its strings) of each failed payload
