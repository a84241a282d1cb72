"""What the registry stores, as MLflow sees it and as our callers get it back: the aliases, the
tag names, the model name of a target, and the typed records of a version (`VersionInfo`), its
lineage (`Lineage`) and an action in the history (`ActionRecord`)."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from adaflash import __version__

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous_champion"
ALIASES = (CHAMPION, CHALLENGER, PREVIOUS_CHAMPION)

# Tags (model version unless noted). `adaflash.approval` is the one a person sets in the MLflow UI.
T_FINGERPRINT = "adaflash.target_fingerprint"
T_TARGET = "adaflash.target_name"
T_STATUS = "adaflash.status"  # registered | challenger | champion | previous_champion | rolled_back
T_APPROVAL = "adaflash.approval"  # pending | approved | superseded
T_CODE = "adaflash.code_version"
T_REPLACED = "adaflash.replaced_version"  # the champion this version replaced when promoted
T_ACTION = "adaflash.action"  # history runs
T_GATE = "adaflash.gate"  # promote | reject: the shadow gate's decision on this version
T_GATE_REASON = "adaflash.gate_reason"
T_GATE_OVERRIDE = "adaflash.gate_override"  # "true" once a person promoted it over a reject
T_PROMOTION = "adaflash.promotion"  # JSON `PromotionRecord`: the recorded move of champion to this version
REJECT = "reject"
GATE_PROMOTE = "promote"
OVERRIDE_REASON = "manual override of the shadow gate's reject: "  # prefixes the promotion's reason
APPROVED = "approved"
PENDING = "pending"
SUPERSEDED = "superseded"  # a pending challenger replaced by a newer one before anyone approved it
DRAFTER_ARTIFACT = "drafter"
REQUIRED_FILES = ("config.json", "model.safetensors", "adaflash.json")

# MLflow rejects longer tag values; the full lineage lives in the run's lineage.json.
_MAX_TAG = 4000


def model_name_for(fingerprint: str) -> str:
    return f"adaflash-drafter-{fingerprint[:16]}"


def default_who() -> str:
    try:
        return os.environ.get("ADAFLASH_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def current_code_version() -> str:
    """The git sha of the checkout the code runs from (+dirty), else the package version."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return f"adaflash-{__version__}"
    return f"{sha}+dirty" if dirty else sha


def as_version(version: Any) -> str:
    # SQLite-backed stores hand back ints, the REST API strings: one type everywhere.
    return str(version)


def now_utc() -> datetime:
    return datetime.now(UTC)


def clip_tag(value: str) -> str:
    return (
        value
        if len(value) <= _MAX_TAG
        else value[: _MAX_TAG - 40] + f"… (+{len(value) - _MAX_TAG + 40} chars)"
    )


class Lineage(BaseModel):
    """What a version trained on. Extra keys are kept in `lineage.json`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    shard_ids: list[str] = Field(default_factory=list, alias="shards")
    record_count: int = Field(0, alias="n_records")
    tenants: list[str] = Field(default_factory=list)
    # "topic:partition" (or any label) -> [first offset, last offset]
    offsets: dict[str, list[int]] = Field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        shards = ",".join(self.shard_ids)
        offsets = ", ".join(f"{k}={v[0]}-{v[-1]}" if v else k for k, v in sorted(self.offsets.items()))
        return {
            "adaflash.lineage.records": str(self.record_count),
            "adaflash.lineage.shard_count": str(len(self.shard_ids)),
            "adaflash.lineage.shards": clip_tag(shards),
            "adaflash.lineage.tenants": clip_tag(",".join(sorted(self.tenants))),
            "adaflash.lineage.offsets": clip_tag(offsets),
        }


def flatten_metrics(metrics: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_metrics(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class VersionInfo:
    model_name: str
    version: str
    aliases: list[str]
    status: str
    approval: str | None
    created_at: datetime
    source: str
    run_id: str | None
    code_version: str | None
    metrics: dict[str, str]
    lineage: dict[str, str]
    description: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class ActionRecord:
    at: datetime
    action: str
    version: str
    who: str
    reason: str
    alias: str | None
    replaced_version: str | None
    event_id: str
    event_published: bool
    run_id: str


# How a promotion record authorises its move of `champion`: the shadow gate's evidence (`gate`), a
# person's approval of a pending challenger (`approval`), a person's override of the gate's reject
# (`override`), a person's promotion of a version no gate judged (`manual`, e.g. the first
# champion), or `rollback` to the previous champion.
PROMOTION_MODES = ("gate", "approval", "override", "manual", "rollback")


@dataclass(frozen=True)
class PromotionRecord:
    """What the registry client writes on a version (tag `adaflash.promotion`) before it moves
    `champion` to it: which move it authorises (`seq`, the registry's count of recorded champion
    moves; `replaced`, the champion it moved from), how (`mode`, `evidence`), who and why.

    Servers follow a champion only when its version carries the newest record: a raw MLflow call
    moves the alias but writes no record, and replaying the alias onto an older champion finds a
    record that a later one superseded."""

    seq: int
    version: str
    replaced: str | None
    mode: str
    actor: str
    reason: str
    evidence: str
    at: str
    alias: str = CHAMPION

    def to_tag(self) -> str:
        # Reason and evidence are clipped so the whole JSON stays under MLflow's tag limit.
        short = {**asdict(self), "reason": self.reason[:1500], "evidence": self.evidence[:1500]}
        return json.dumps(short, sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_tag(cls, raw: str | None) -> PromotionRecord | None:
        """The record in a tag value; None when there is none or it is not one of ours."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            rec = cls(**d)
        except (json.JSONDecodeError, TypeError):
            return None
        return rec if isinstance(rec.seq, int) and isinstance(rec.version, str) else None

    def problem(self, version: str, gate: str | None) -> str | None:
        """Why this record does not authorise `version` (whose shadow gate said `gate`) as champion."""
        if self.version != version or self.alias != CHAMPION:
            return f"its promotion record is for {self.alias} v{self.version}"
        if self.mode not in PROMOTION_MODES or not self.actor.strip() or not self.reason.strip():
            return "its promotion record has no valid mode, actor or reason"
        if gate == REJECT and self.mode not in ("override", "rollback"):
            return "the shadow gate rejected it and its promotion record is no override"
        return None


@dataclass(frozen=True)
class ChampionAudit:
    """The champion alias checked against the promotion records (`RegistryReader.audit_champion`)."""

    alias_version: str | None  # where the champion alias points now
    recorded: PromotionRecord | None  # the newest promotion record of any version
    problem: str | None  # why the alias's version is not an authorised champion; None when it is

    @property
    def authorised(self) -> str | None:
        """The version to serve: the alias's, when a recorded move put it there."""
        return self.alias_version if self.problem is None else None

    @property
    def recorded_version(self) -> str | None:
        """The champion by the records: the last version the registry client moved it to."""
        return self.recorded.version if self.recorded is not None else None
