"""Publishes `DrafterEvent`s on `adaflash.drafter.events`; a missing broker never fails an action.

The registry action (an alias move in MLflow) is the source of truth and is already durable when
the event is sent; the event only tells the fleet sooner. So when no broker is configured or it
does not answer, the event is logged and recorded as unpublished in the action's history, and
the fleet still finds the champion by watching the alias.
"""

from __future__ import annotations

import logging
import socket

from adaflash.feedback.events import DrafterEvent
from adaflash.feedback.security import client_kwargs
from adaflash.feedback.topics import DRAFTER_EVENTS, TOPICS

log = logging.getLogger(__name__)


def _reachable(bootstrap_servers: str) -> bool:
    # kafka-python spends its whole api-version probe timeout on a dead address; a TCP connect
    # answers in milliseconds, so an unreachable broker costs the CLI nothing.
    for address in bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host or "localhost", int(port)), timeout=0.5):
                return True
        except (OSError, ValueError):
            continue
    return False


class EventPublisher:
    def __init__(self, bootstrap_servers: str | None, topic: str = DRAFTER_EVENTS) -> None:
        self.bootstrap_servers = bootstrap_servers or None
        self.topic = topic
        self._producer = None

    def _ensure_producer(self):
        if self._producer is not None:
            return self._producer
        from kafka import KafkaProducer

        from adaflash.feedback.broker import ensure_topics

        ensure_topics(self.bootstrap_servers, tuple(t for t in TOPICS if t.name == self.topic))
        # acks=all + idempotence (kafka-python 3 defaults): an acknowledged event is on the log once.
        self._producer = KafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            **client_kwargs(),
            acks="all",
            max_block_ms=10_000,
            request_timeout_ms=10_000,
        )
        return self._producer

    def publish(self, event: DrafterEvent) -> bool:
        """Send and wait for the acknowledgement; False (logged) when there is no broker."""
        if self.bootstrap_servers is None:
            log.info("no Kafka bootstrap servers configured: %s event for %s v%s not published",
                     event.type, event.model_name, event.version)  # fmt: skip
            return False
        if not _reachable(self.bootstrap_servers):
            log.warning("Kafka at %s is unreachable: %s event for %s v%s not published",
                        self.bootstrap_servers, event.type, event.model_name, event.version)  # fmt: skip
            return False
        try:
            self._ensure_producer().send(self.topic, key=event.key, value=event.to_bytes()).get(timeout=15)
            return True
        except Exception as e:  # kafka-python raises many types; the action itself already happened
            log.warning("could not publish %s event for %s v%s on %s: %s",
                        event.type, event.model_name, event.version, self.topic, e)  # fmt: skip
            self.close()
            return False

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=5)
            finally:
                self._producer = None
