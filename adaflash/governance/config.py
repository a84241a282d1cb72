"""Governance's settings and the layout of its folder: every path below `data_dir` is a
property here, so the governor, the pipeline's steps, the CLI and the demo agree on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adaflash.feedback import topics
from adaflash.governance.checks import Limits
from adaflash.governance.filters import FilterConfig


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
