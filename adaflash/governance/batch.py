"""The records one governance batch moves through: the consumed `Message`, what `_parse` and
`_scrub` made of it, the `BatchOutcome`, and the `GovernanceConfig` (`governor.py` runs them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaflash.feedback import topics
from adaflash.feedback.schema import CleanRecord, FeedbackRecord, QuarantineRecord
from adaflash.governance.checks import Limits
from adaflash.governance.filters import FilterConfig
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


@dataclass(frozen=True)
class GovernanceConfig:
    data_dir: Path
    bootstrap_servers: str = topics.DEFAULT_BOOTSTRAP
    group_id: str = "adaflash-governance"
    batch_size: int = 256
    poll_timeout_ms: int = 1000
    limits: Limits = Limits()
    filters: FilterConfig = FilterConfig()
    # Poison-pill caps, checked before anything parses or scrubs a payload: a bigger or deeper
    # one is quarantined unread. 512 KiB keeps every text below spaCy's 1M-character limit.
    max_payload_bytes: int = 512 * 1024
    max_json_depth: int = 32
    # A text longer than this is not scrubbed: its record is quarantined as `too_large` and keeps
    # no text. 16 characters per token of the 4096-token limits: no record that could train is
    # this long, and the NER scrub costs seconds per 10k tokens on 2 cores (issue 32).
    max_scrub_chars: int = 65_536

    @property
    def buffer_dir(self) -> Path:
        return self.data_dir / "buffer"

    @property
    def lineage_path(self) -> Path:
        return self.data_dir / "lineage.sqlite"


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
