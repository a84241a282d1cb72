"""Fire-and-forget feedback producer with a bounded on-disk spool.

`send()` never blocks the caller (the serving step loop): records go to an in-memory queue that a
background thread produces to Kafka. When the broker is unreachable, records are appended to spool
segments on disk and replayed, oldest first, once the broker answers again. Delivery is
at-least-once (a record whose acknowledgement was lost is sent again); consumers dedupe by
`record_id`. The spool holds raw (pre-governance) records, so its files are private to the user
(0600) and deleted as soon as they are replayed; when it is full, new records are refused and
counted in `stats["spool_dropped"]` rather than growing without bound.

An acknowledgement alone does not count as delivered. A broker shutting down gracefully
(SIGTERM) keeps serving the connections it has and acknowledges their sends, while it refuses new
ones — and the embedded broker's memory-only topics die with it. So after each acknowledged batch
the producer checks that the broker still answers a *new* connection (a Kafka ApiVersions
handshake); if it does not, the batch is treated as not delivered and spooled, to be replayed
(consumers dedupe by `record_id`, so a batch the broker did keep is not counted twice).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from adaflash.feedback.schema import FeedbackRecord
from adaflash.feedback.security import KafkaSecurity
from adaflash.feedback.topics import RAW

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class ProducerConfig:
    bootstrap_servers: str
    spool_dir: Path
    topic: str = RAW
    max_spool_bytes: int = 256 * 1024 * 1024
    retry_seconds: float = 1.0  # between reconnection attempts while the broker is down
    batch_size: int = 256


@dataclass
class _Stats:
    sent: int = 0
    spooled: int = 0
    replayed: int = 0
    spool_dropped: int = 0
    send_errors: int = 0
    unconfirmed: int = 0  # acknowledged by a broker that then stopped answering: spooled again
    spool_records: int = 0
    connected: bool = False
    extra: dict = field(default_factory=dict)


def _reachable(address: str) -> bool:
    host, _, port = address.strip().rpartition(":")
    try:
        with socket.create_connection((host or "localhost", int(port)), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


# ApiVersions v0 (api key 18), correlation id 0x0AF1, client id "adaflash-probe".
_CLIENT = b"adaflash-probe"
_API_VERSIONS = struct.pack(">hhih", 18, 0, 0x0AF1, len(_CLIENT)) + _CLIENT
_API_VERSIONS = struct.pack(">i", len(_API_VERSIONS)) + _API_VERSIONS


def broker_answers(address: str, timeout: float = 1.0, security: KafkaSecurity | None = None) -> bool:
    """True when a broker at `address` answers a Kafka request on a fresh connection — not just
    accepts TCP: a draining broker accepts and then resets new connections. `security` says how
    the listener is reached (TLS or not; ApiVersions needs no SASL login); default plaintext."""
    host, _, port = address.strip().rpartition(":")
    try:
        with (
            socket.create_connection((host or "localhost", int(port)), timeout=timeout) as raw,
            (security or KafkaSecurity()).wrap(raw, host or "localhost") as sock,
        ):
            sock.settimeout(timeout)
            sock.sendall(_API_VERSIONS)
            head = b""
            while len(head) < 8:
                chunk = sock.recv(8 - len(head))
                if not chunk:
                    return False
                head += chunk
            size, correlation = struct.unpack(">ii", head)
            return size >= 4 and correlation == 0x0AF1
    except (OSError, ValueError):
        return False


class FeedbackProducer:
    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self._security = KafkaSecurity.from_env()  # a bad setting fails here, at start, in one line
        config.spool_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(config.spool_dir, 0o700)
        self._queue: queue.Queue = queue.Queue()
        self._stats = _Stats()
        self._stats.spool_records = sum(  # a spool left by an earlier process counts from the start
            sum(1 for line in p.read_text().splitlines() if line.strip()) for p in self._segments()
        )
        self._producer = None
        self._next_connect = 0.0
        self._seq = 0
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feedback-producer", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------
    def send(self, record: FeedbackRecord) -> None:
        self.send_raw(record.tenant_id.encode(), record.to_bytes())

    def send_raw(self, key: bytes | None, value: bytes) -> None:
        self._idle.clear()
        self._queue.put((key, value))

    @property
    def stats(self) -> dict:
        s = self._stats
        return {
            "sent": s.sent,
            "spooled": s.spooled,
            "replayed": s.replayed,
            "spool_dropped": s.spool_dropped,
            "send_errors": s.send_errors,
            "unconfirmed": s.unconfirmed,
            "connected": s.connected,
            "spool_records": s.spool_records,
            "spool_bytes": self.spool_bytes(),
            "queued": self._queue.qsize(),
        }

    def spool_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._segments())

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued record is either acknowledged by the broker or spooled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05) and self._queue.empty():
                return True
        return False

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._producer is not None:
            self._producer.close(timeout=5)
            self._producer = None

    # -- background thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch, stop = self._take_batch()
            if batch:
                if self._ensure_producer() and self._replay_spool():
                    failed = self._produce(batch)
                    self._stats.sent += len(batch) - len(failed)
                    if failed:
                        self._spool(failed)
                else:
                    self._spool(batch)
            elif self._segments() and self._ensure_producer():
                self._replay_spool()
            if stop:
                return
            if self._queue.empty():
                self._idle.set()

    def _take_batch(self) -> tuple[list, bool]:
        batch: list = []
        try:
            item = self._queue.get(timeout=self.config.retry_seconds / 2)
        except queue.Empty:
            return batch, False
        while True:
            if item is _STOP:
                return batch, True
            batch.append(item)
            if len(batch) >= self.config.batch_size:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False

    def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        if time.monotonic() < self._next_connect:
            return False
        self._next_connect = time.monotonic() + self.config.retry_seconds
        # kafka-python spends ~30 s failing to bootstrap from a dead address; a probe is instant.
        if not self._broker_answers():
            self._stats.connected = False
            return False
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        try:
            self._producer = KafkaProducer(
                bootstrap_servers=self.config.bootstrap_servers,
                **self._security.client_kwargs(),
                acks="all",
                linger_ms=5,
                max_block_ms=3000,
                request_timeout_ms=3000,
                delivery_timeout_ms=6000,
                reconnect_backoff_max_ms=1000,
            )
        except (KafkaError, OSError) as exc:
            log.debug("feedback broker unreachable: %s", exc)
            self._stats.connected = False
            return False
        self._stats.connected = True
        return True

    def _produce(self, items: list) -> list:
        """Send and wait for acknowledgements; returns the items that were not acknowledged."""
        from kafka.errors import KafkaError

        futures = []
        failed = []
        for key, value in items:
            try:
                futures.append(((key, value), self._producer.send(self.config.topic, key=key, value=value)))
            except (KafkaError, OSError):
                failed.append((key, value))
        for item, fut in futures:
            try:
                fut.get(timeout=10)
            except (KafkaError, OSError):
                failed.append(item)
        if failed:
            self._stats.send_errors += len(failed)
            self._drop_producer()
        elif items and not self._broker_answers():
            # Acknowledged by a broker that no longer takes connections (shutting down): what it
            # acknowledged may die with it. Not delivered: spool and replay.
            log.warning(
                "feedback broker stopped answering after acknowledging %d records: spooling them", len(items)
            )
            self._stats.unconfirmed += len(items)
            self._drop_producer()
            return list(items)
        return failed

    def _broker_answers(self) -> bool:
        return any(
            broker_answers(a, security=self._security) for a in self.config.bootstrap_servers.split(",")
        )

    def _drop_producer(self) -> None:
        self._stats.connected = False
        if self._producer is not None:
            try:
                self._producer.close(timeout=0)
            except Exception:  # noqa: BLE001 - a broken client must not kill the thread
                pass
        self._producer = None
        self._next_connect = time.monotonic() + self.config.retry_seconds

    # -- spool ----------------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        return sorted(self.config.spool_dir.glob("spool-*.jsonl"))

    def _spool(self, items: list) -> None:
        lines = [
            json.dumps({"k": k.decode() if k is not None else None, "v": v.decode()}) + "\n" for k, v in items
        ]
        room = self.config.max_spool_bytes - self.spool_bytes()
        keep = []
        for line in lines:
            if len(line) > room:
                self._stats.spool_dropped += 1
                continue
            room -= len(line)
            keep.append(line)
        if len(keep) < len(lines):
            refused = len(lines) - len(keep)
            log.error(
                "feedback spool full (limit %d bytes): refused %d records",
                self.config.max_spool_bytes,
                refused,
            )
        if not keep:
            return
        self._seq += 1
        path = self.config.spool_dir / f"spool-{time.time_ns():020d}-{self._seq:06d}.jsonl"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)  # a segment is visible only when complete
        self._stats.spooled += len(keep)
        self._stats.spool_records += len(keep)

    def _replay_spool(self) -> bool:
        """Send spooled segments oldest first; True when the spool is empty afterwards."""
        for path in self._segments():
            items = []
            for line in path.read_text().splitlines():
                if line.strip():
                    d = json.loads(line)
                    items.append((d["k"].encode() if d["k"] is not None else None, d["v"].encode()))
            failed = self._produce(items)
            if failed:
                return False
            path.unlink()
            self._stats.replayed += len(items)
            self._stats.spool_records -= len(items)
        return True
