"""What fills the suffix cache: `adaflash.feedback.clean`, the governed stream, never raw traffic.

A thread in the serving process reads every partition of the clean topic (no consumer group:
`assign()`, so a server needs Read on the topic and no group ACL, and every replica of a fleet
sees every record) and adds each governed response to its tenant's index within a poll (~0.3 s
after governance published it). Skipped, and counted by reason: another target's records, a
tenant that did not consent, records that do not parse.

On start it replays the newest `replay` records of each partition: a restarted or redeployed
server rebuilds what it had learned from the same governed records (the cache's caps then keep
the newest). Durability of that history is the topic's retention (the embedded Tansu broker
keeps it for the broker's life; a production Kafka for its retention period).
"""

from __future__ import annotations

import logging
import threading

from pydantic import ValidationError

from adaflash.feedback.schema import CleanRecord
from adaflash.feedback.security import KafkaSecurity
from adaflash.feedback.topics import CLEAN
from adaflash.serving.suffix_cache import SuffixCache

log = logging.getLogger(__name__)

REPLAY = 5_000  # newest clean records per partition read again at start


class CleanFeed:
    def __init__(
        self,
        cache: SuffixCache,
        bootstrap_servers: str,
        fingerprint: str | None,
        security: KafkaSecurity | None = None,
        replay: int = REPLAY,
    ) -> None:
        self.cache, self.bootstrap_servers = cache, bootstrap_servers
        self.fingerprint, self.replay = fingerprint, replay
        self.security = security or KafkaSecurity.from_env()
        self.applied = 0
        self.error: str | None = None  # the last failure of the feed, shown by /health
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run_forever, name="suffix-feed", daemon=True)

    def start(self, wait: float = 30.0) -> CleanFeed:
        self._thread.start()
        self._ready.wait(wait)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def apply(self, payload: bytes, where: str, offset: int) -> bool:
        """One clean-topic message into the cache (True when it taught the cache something)."""
        try:
            clean = CleanRecord.model_validate_json(payload)
        except (ValidationError, ValueError):
            self.cache.skip("invalid")
            return False
        rec = clean.record
        if self.fingerprint is not None and rec.target_fingerprint != self.fingerprint:
            self.cache.skip("target")
            return False
        if not rec.consent:  # governance does not publish these; a second lock on the door
            self.cache.skip("consent")
            return False
        added = self.cache.add(rec.tenant_id, rec.record_id, rec.output_token_ids, where, offset)
        self.applied += added
        return added

    def _run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self._run()
            except Exception as e:  # noqa: BLE001 - a broker outage: the cache keeps what it has
                self.error = f"{type(e).__name__}: {e}"
                log.warning("suffix feed: %s; retrying in 5 s", self.error)
                self._stop.wait(5)

    def _run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            **self.security.client_kwargs(),
            enable_auto_commit=False,
        )
        try:
            parts = [TopicPartition(CLEAN, p) for p in sorted(consumer.partitions_for_topic(CLEAN) or [0])]
            consumer.assign(parts)
            begin, end = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
            for tp in parts:
                consumer.seek(tp, max(begin[tp], end[tp] - self.replay))
            self.error = None
            self._ready.set()
            while not self._stop.is_set():
                for tp, msgs in consumer.poll(timeout_ms=300, max_records=500).items():
                    for m in msgs:
                        self.apply(m.value, f"{tp.topic}/{tp.partition}", m.offset)
        finally:
            consumer.close()
