"""Drafter lifecycle events on `adaflash.drafter.events` (DESIGN §2): registry -> serving fleet.

The registry publishes one event per action. For a server an event is only a hint: when its
`alias` is `champion` (`promoted`: the new champion; `rolled_back`: the restored one,
`replaced_version` the one demoted), re-read the champion from *its own configured* registry and
serve it only when a promotion record authorises it (`RegistryReader.audit_champion`). Anyone who
can write to the topic can forge an event, so `tracking_uri` and `artifact_uri` say where the
action happened, for people and logs: a server never dials them. `registered` and `approved`
events are informational for the fleet. Versions are strings whatever the MLflow store returned
(SQLite gives ints, REST strings). Keyed by the registered model name; the topic has one
partition, so events are ordered.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

EVENT_SCHEMA_VERSION = 1

EventType = Literal["registered", "approved", "promoted", "rolled_back"]


class EventSchemaError(ValueError):
    """A payload that is not a drafter event of a version we understand."""


class DrafterEvent(BaseModel):
    # Unknown fields are an error: a producer on a newer schema must bump `schema_version`.
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = EVENT_SCHEMA_VERSION
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    type: EventType
    model_name: str  # the registered model (one per target fingerprint)
    version: str  # the version this event is about; for promoted/rolled_back: the champion now
    alias: str | None  # the alias `version` holds after the action (champion, challenger, ...)
    replaced_version: str | None = None  # promoted: the old champion; rolled_back: the demoted one
    target_fingerprint: str
    who: str
    reason: str
    timestamp: datetime = Field(default_factory=lambda: datetime.now(UTC))
    artifact_uri: str  # the drafter directory in MLflow's artifact store (informational)
    tracking_uri: str  # the MLflow server of the action (informational: servers never dial it)

    @field_validator("version", "replaced_version", mode="before")
    @classmethod
    def _version_str(cls, v: object) -> object:
        # MLflow's SQLite store returns ints, its REST API strings: events always carry strings.
        return str(v) if isinstance(v, int) else v

    @property
    def key(self) -> bytes:
        return self.model_name.encode()

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> DrafterEvent:
        try:
            return cls.model_validate_json(payload)
        except ValidationError as e:
            raise EventSchemaError(f"not a drafter event: {e.errors()[0]['msg']}") from None
