"""The governance service: the Kafka loop around a `Governor` (governor.py).

Poll a batch of adaflash.feedback.raw → `govern` → `persist` (shards, clean and quarantine
topics acknowledged, lineage + audit in one transaction) → only then commit offsets. A crash
anywhere re-delivers the batch and the dedupe turns it into a no-op for the buffer (topic
consumers dedupe by record id: delivery there is at-least-once).

A full disk (ENOSPC on a shard, SQLite's "disk is full" on the lineage store) is a fault the loop
survives (issue 32): the governed batch is kept, its partitions are paused (polling goes on, so
the consumer stays in its group), nothing is committed, and the same batch is persisted again
after a backoff, until space returns. Retrying the persist rather than re-governing keeps the
flood and near-duplicate windows from counting the batch twice.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from adaflash.feedback import topics
from adaflash.feedback.security import client_kwargs
from adaflash.governance.governor import BatchOutcome, GovernanceConfig, Governor, Message
from adaflash.governance.lineage import BatchAudit

log = logging.getLogger(__name__)


def disk_full(e: BaseException) -> bool:
    """ENOSPC from a file write, or SQLite's SQLITE_FULL ("database or disk is full")."""
    if isinstance(e, sqlite3.OperationalError):
        return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e)
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


@dataclass
class _Pending:
    """A governed batch whose output could not be written yet."""

    out: BatchOutcome
    started: datetime
    messages: list[Message]


class GovernanceService:
    """Kafka loop around a `Governor`: poll a batch, govern, persist, then commit offsets."""

    def __init__(self, cfg: GovernanceConfig, governor: Governor) -> None:
        from kafka import KafkaConsumer

        self.cfg = cfg
        self.governor = governor
        self.consumer = KafkaConsumer(
            topics.RAW,
            bootstrap_servers=cfg.bootstrap_servers,
            **client_kwargs(),
            group_id=cfg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=cfg.batch_size,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )
        self._backoff = 0.0
        self._pending: _Pending | None = None
        self.disk_full_errors = 0  # persists that failed for want of space (each retried)
        self._reset_producer()

    def _reset_producer(self) -> None:
        from kafka import KafkaProducer

        old, self.producer = getattr(self, "producer", None), None
        if old is not None:
            try:
                old.close(timeout=0)
            except Exception:  # noqa: BLE001 - a broken client must not stop the loop
                pass
        self.producer = KafkaProducer(
            bootstrap_servers=self.cfg.bootstrap_servers, **client_kwargs(), acks="all", linger_ms=5
        )

    def _rewind(self, messages: list[Message]) -> None:
        """Seek every partition of an unpersisted batch back to its first message."""
        from kafka import TopicPartition

        first: dict[tuple[str, int], int] = {}
        for m in messages:
            first[(m.topic, m.partition)] = min(m.offset, first.get((m.topic, m.partition), m.offset))
        for (topic, partition), offset in first.items():
            try:
                self.consumer.seek(TopicPartition(topic, partition), offset)
            except Exception as e:  # noqa: BLE001 - reassigned meanwhile: the new owner re-reads it
                log.warning("could not rewind %s/%d to %d: %s", topic, partition, offset, e)

    def run_once(self) -> BatchAudit | None:
        if self._pending is not None:  # the disk was full: write the same batch again
            p = self._pending
            return self._persist(p.out, p.started, p.messages)
        polled = self.consumer.poll(timeout_ms=self.cfg.poll_timeout_ms, max_records=self.cfg.batch_size)
        messages = [
            Message(tp.topic, tp.partition, m.offset, m.key, m.value)
            for tp, msgs in polled.items()
            for m in msgs
        ]
        if not messages:
            return None
        started = datetime.now(UTC)
        return self._persist(self.governor.govern(messages), started, messages)

    def _persist(self, out: BatchOutcome, started: datetime, messages: list[Message]) -> BatchAudit | None:
        from kafka.errors import KafkaError

        try:
            audit = self.governor.persist(out, started, self.producer)
            self.consumer.commit()  # only now: every output above is durable
        except (OSError, sqlite3.OperationalError) as e:
            if not disk_full(e):
                raise
            self.disk_full_errors += 1
            self._pending = _Pending(out, started, messages)
            self._backoff = min(max(2 * self._backoff, 0.5), 30.0)
            log.warning(
                "disk full (%s): batch of %d not persisted, no offset committed (%d so far); retry in %.1fs",
                e, len(messages), self.disk_full_errors, self._backoff,
            )  # fmt: skip
            self._wait_paused(self._backoff)
            return None
        except KafkaError as e:
            self._clear_pending()
            # Not a per-record failure: the broker went away or came back empty (a restarted
            # embedded broker does not know the idempotent producer's id: UnknownProducerIdError).
            # Left to escape, it would end `governance run` for good. Nothing is committed yet, so
            # rewind to the batch, start a fresh producer and retry after a backoff; if lineage
            # is already written, the re-delivered batch is counted as duplicates, not twice.
            self._backoff = min(max(2 * self._backoff, 0.5), 10.0)
            log.warning("batch not persisted (%s): retrying in %.1fs", e, self._backoff)
            self._rewind(messages)
            self._reset_producer()
            time.sleep(self._backoff)
            return None
        self._backoff = 0.0
        self._clear_pending()
        log.info(
            "batch %s: in=%d clean=%d quarantined=%d duplicate=%d",
            audit.batch_id[:8],
            audit.n_in,
            audit.n_clean,
            audit.n_quarantined,
            audit.n_duplicate,
        )
        return audit

    def _wait_paused(self, seconds: float) -> None:
        """Wait with every assigned partition paused, polling so the consumer keeps its group
        membership. A partition assigned meanwhile is not paused: what it yields is rewound."""
        self.consumer.pause(*self.consumer.assignment())
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            polled = self.consumer.poll(timeout_ms=int(left * 1000) + 1)
            got = [
                Message(tp.topic, tp.partition, m.offset, m.key, m.value)
                for tp, ms in polled.items()
                for m in ms
            ]
            if got:
                self._rewind(got)
                self.consumer.pause(*self.consumer.assignment())

    def _clear_pending(self) -> None:
        if self._pending is not None:
            self._pending = None
            self.consumer.resume(*self.consumer.paused())

    def run(self, max_batches: int | None = None, idle_exit_s: float | None = None, on_batch=None) -> int:
        n, idle_since = 0, time.monotonic()
        while max_batches is None or n < max_batches:
            audit = self.run_once()
            if audit is None:
                idle = time.monotonic() - idle_since
                if idle_exit_s is not None and idle > idle_exit_s and self._pending is None:
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
