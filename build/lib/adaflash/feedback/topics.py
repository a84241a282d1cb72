"""Kafka topic names and layout (DESIGN §2). Every producer/consumer takes these from here."""

from __future__ import annotations

from dataclasses import dataclass

RAW = "adaflash.feedback.raw"  # serving -> governance
CLEAN = "adaflash.feedback.clean"  # governance -> training
QUARANTINE = "adaflash.feedback.quarantine"  # governance: rejected record + reasons
DRAFTER_EVENTS = "adaflash.drafter.events"  # registry -> serving fleet (promotions, rollbacks)

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int


# Feedback is keyed by tenant, so partitions bound the parallelism of governance consumers.
TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec(RAW, 4),
    TopicSpec(CLEAN, 4),
    TopicSpec(QUARANTINE, 1),
    TopicSpec(DRAFTER_EVENTS, 1),
)
