"""The governance service: the Kafka loop around a `Governor` (governor.py).

Poll a batch of adaflash.feedback.raw → `govern` → `persist` (shards, clean and quarantine
topics acknowledged, lineage + audit in one transaction) → only then commit offsets. A crash
anywhere re-delivers the batch and the dedupe turns it into a no-op for the buffer (topic
consumers dedupe by record id: delivery there is at-least-once).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from adaflash.feedback import topics
from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.lineage import BatchAudit

log = logging.getLogger(__name__)


class GovernanceService:
    """Kafka loop around a `Governor`: poll a batch, govern, persist, then commit offsets."""

    def __init__(self, cfg: GovernanceConfig, governor: Governor) -> None:
        from kafka import KafkaConsumer, KafkaProducer

        self.cfg = cfg
        self.governor = governor
        self.consumer = KafkaConsumer(
            topics.RAW,
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=cfg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=cfg.batch_size,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )
        self.producer = KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", linger_ms=5)

    def run_once(self) -> BatchAudit | None:
        polled = self.consumer.poll(timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.batch_size)
        messages = [
            Message(tp.topic, tp.partition, m.offset, m.key, m.value)
            for tp, msgs in polled.items()
            for m in msgs
        ]
        if not messages:
            return None
        started = datetime.now(UTC)
        out = self.governor.govern(messages)
        audit = self.governor.persist(out, started, self.producer)
        self.consumer.commit()  # only now: every output above is durable
        log.info(
            "batch %s: in=%d clean=%d quarantined=%d duplicate=%d",
            audit.batch_id[:8],
            audit.n_in,
            audit.n_clean,
            audit.n_quarantined,
            audit.n_duplicate,
        )
        return audit

    def run(self, max_batches: int | None = None, idle_exit_s: float | None = None, on_batch=None) -> int:
        n, idle_since = 0, time.monotonic()
        while max_batches is None or n < max_batches:
            audit = self.run_once()
            if audit is None:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            n += 1
            idle_since = time.monotonic()
            if on_batch is not None:
                on_batch(audit)
        return n

    def close(self) -> None:
        self.consumer.close()
        self.producer.close(timeout=5)
        self.governor.lineage.close()
