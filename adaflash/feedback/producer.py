"""Fire-and-forget feedback producer with a bounded on-disk spool.

`send()` never blocks the caller (the serving step loop): records go to an in-memory queue that a
background thread produces to Kafka. When the broker is unreachable, records are appended to spool
segments on disk and replayed, oldest first, once the broker answers again. Delivery is
at-least-once (a record whose acknowledgement was lost is sent again); consumers dedupe by
`record_id`. The spool holds raw (pre-governance) records, so its files are private to the user
(0600) and deleted as soon as they are replayed; when it is full, new records are refused and
counted in `stats["spool_dropped"]` rather than growing without bound.

A spool that cannot be written (a full disk: ENOSPC, or any other OSError) is a fault the
producer survives, not one that ends its thread. The records are held in memory (at most
`max_held_records`; beyond that the oldest are dropped and counted), the write is retried with
exponential backoff, and `degraded` says why until a write succeeds or the broker takes the held
records. Every record `send` accepted is therefore acknowledged, on disk, held, or counted in
`stats["dropped"]` — including those still held when the producer is closed.

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
from collections import deque
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
    max_held_records: int = 10_000  # held in memory while the spool cannot be written
    max_disk_backoff_seconds: float = 30.0  # between spool write attempts while they fail


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
    spool_write_errors: int = 0  # spool writes that failed (ENOSPC, EIO, ...)
    disk_dropped: int = 0  # records neither the broker nor the disk took, beyond the memory hold
    oversize_dropped: int = 0  # records past the broker's size limit: no retry can deliver them
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
        # Records that neither the broker nor the spool took, oldest first (see the module doc).
        self._held: deque = deque()
        self._degraded: str | None = None
        self._disk_backoff = 0.0
        self._next_disk_try = 0.0
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
            "spool_write_errors": s.spool_write_errors,
            "held": len(self._held),
            "oversize_dropped": s.oversize_dropped,
            "dropped": s.spool_dropped + s.disk_dropped + s.oversize_dropped,
            "degraded": self.degraded,
        }

    def health(self) -> dict:
        """What /health shows: cheap (no filesystem), read from another thread."""
        s = self._stats
        dropped = s.spool_dropped + s.disk_dropped + s.oversize_dropped
        return {"degraded": self._degraded, "held": len(self._held), "dropped": dropped,
                "spool_write_errors": s.spool_write_errors}  # fmt: skip

    @property
    def degraded(self) -> str | None:
        """Why records are waiting in memory (the spool cannot be written), or None."""
        return self._degraded

    def spool_bytes(self) -> int:
        total = 0
        for p in self._segments():
            try:
                total += p.stat().st_size
            except OSError:  # replayed and deleted meanwhile
                pass
        return total

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued record is acknowledged by the broker, spooled, or held in
        memory because the spool cannot be written (`degraded`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05) and self._queue.empty():
                return True
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Deliver or spool what is queued, then stop; a record still held in memory (neither the
        broker nor the disk took it) is counted as dropped."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._held and not self._thread.is_alive():
            log.error("feedback: %d records neither delivered nor spooled at close: dropped", len(self._held))
            self._stats.disk_dropped += len(self._held)
            self._held.clear()
        if self._producer is not None:
            self._producer.close(timeout=5)
            self._producer = None

    # -- background thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch, stop = self._take_batch()
            try:
                self._deliver(batch)
            except Exception:  # noqa: BLE001 - the thread must outlive any fault; keep the records
                log.exception("feedback producer: unexpected error; holding %d records", len(batch))
                self._hold(batch)
            if stop:
                return
            if self._queue.empty():
                self._idle.set()

    def _deliver(self, batch: list) -> None:
        """Broker first (after the spool's older records), else the spool; records held in
        memory go out before `batch`, oldest first."""
        if (batch or self._held) and self._ensure_producer() and self._replay_spool():
            items = self._take_held() + batch
            failed, oversize = self._produce(items)
            self._stats.sent += len(items) - len(failed) - oversize
            if failed:
                self._spool(failed)
            elif self._degraded and not self._held:
                log.warning("feedback: the broker took every held record (the spool was unwritable)")
                self._degraded = None
        elif batch or (self._held and time.monotonic() >= self._next_disk_try):
            self._spool(batch)
        elif self._segments() and self._ensure_producer():
            self._replay_spool()

    def _take_held(self) -> list:
        items = list(self._held)
        self._held.clear()
        return items

    def _hold(self, items: list) -> None:
        self._held.extend(items)
        over = len(self._held) - self.config.max_held_records
        if over > 0:  # bounded: the oldest go, counted
            for _ in range(over):
                self._held.popleft()
            self._stats.disk_dropped += over
            log.error("feedback: spool unwritable and %d records held: dropped the %d oldest",
                      self.config.max_held_records, over)  # fmt: skip

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

    def _produce(self, items: list) -> tuple[list, int]:
        """Send and wait for acknowledgements; returns the items that were not acknowledged and
        how many were dropped as oversize.

        A record past the size limit (the client's `max_request_size` or the broker's) is dropped
        and counted, not returned: spooled, it would fail every replay and hold every later record
        behind it in the spool."""
        from kafka.errors import KafkaError, MessageSizeTooLargeError

        futures = []
        failed = []
        oversize = []
        for key, value in items:
            try:
                futures.append(((key, value), self._producer.send(self.config.topic, key=key, value=value)))
            except MessageSizeTooLargeError:
                oversize.append(value)
            except (KafkaError, OSError):
                failed.append((key, value))
        for item, fut in futures:
            try:
                fut.get(timeout=10)
            except MessageSizeTooLargeError:
                oversize.append(item[1])
            except (KafkaError, OSError):
                failed.append(item)
        for value in oversize:
            log.error("feedback record of %d bytes is past the broker's size limit: dropped", len(value))
        self._stats.oversize_dropped += len(oversize)
        if failed:
            self._stats.send_errors += len(failed)
            self._drop_producer()
        elif futures and not self._broker_answers():
            # Acknowledged by a broker that no longer takes connections (shutting down): what it
            # acknowledged may die with it. Not delivered: spool and replay (never an oversize one).
            acked = [item for item, _ in futures]
            log.warning(
                "feedback broker stopped answering after acknowledging %d records: spooling them", len(acked)
            )
            self._stats.unconfirmed += len(acked)
            self._drop_producer()
            return acked, len(oversize)
        return failed, len(oversize)

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
        """Write `items` (after any held ones) as one segment; while writes fail, hold them."""
        items = self._take_held() + items
        if time.monotonic() < self._next_disk_try:  # backing off: do not hammer a full disk
            self._hold(items)
            return
        keep, lines = self._fit(items)
        if not keep:
            return
        self._seq += 1
        path = self.config.spool_dir / f"spool-{time.time_ns():020d}-{self._seq:06d}.jsonl"
        try:
            self._write_segment(path, lines)
        except OSError as exc:
            self._disk_failed(exc, keep, path)
            return
        if self._degraded:
            log.warning("feedback spool writable again: %d records written", len(keep))
        self._degraded, self._disk_backoff, self._next_disk_try = None, 0.0, 0.0
        self._stats.spooled += len(keep)
        self._stats.spool_records += len(keep)

    def _fit(self, items: list) -> tuple[list, list[str]]:
        """The items (and their lines) that fit in the spool's size limit; the rest are counted."""
        room = self.config.max_spool_bytes - self.spool_bytes()
        keep, lines = [], []
        for k, v in items:
            line = json.dumps({"k": k.decode() if k is not None else None, "v": v.decode()}) + "\n"
            if len(line) > room:
                self._stats.spool_dropped += 1
                continue
            room -= len(line)
            keep.append((k, v))
            lines.append(line)
        if len(keep) < len(items):
            log.error("feedback spool full (limit %d bytes): refused %d records", self.config.max_spool_bytes,
                      len(items) - len(keep))  # fmt: skip
        return keep, lines

    def _disk_failed(self, exc: OSError, items: list, path: Path) -> None:
        self._stats.spool_write_errors += 1
        for leftover in (path, path.with_suffix(".tmp")):  # a partial segment must not be replayed
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
        cfg = self.config
        self._disk_backoff = min(max(2 * self._disk_backoff, cfg.retry_seconds), cfg.max_disk_backoff_seconds)
        self._next_disk_try = time.monotonic() + self._disk_backoff
        if self._degraded is None:
            log.error("feedback spool unwritable (%s): holding records in memory, retrying", exc)
        self._degraded = f"spool write failed: {exc.strerror or exc}"
        self._hold(items)

    def _write_segment(self, path: Path, lines: list[str]) -> None:
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)  # a segment is visible only when complete

    def _replay_spool(self) -> bool:
        """Send spooled segments oldest first; True when the spool is empty afterwards."""
        for path in self._segments():
            items = []
            try:
                text = path.read_text()
            except OSError as exc:  # unreadable now (EIO, a vanished file): try again later
                log.warning("feedback spool segment %s unreadable: %s", path.name, exc)
                return False
            for line in text.splitlines():
                if line.strip():
                    d = json.loads(line)
                    items.append((d["k"].encode() if d["k"] is not None else None, d["v"].encode()))
            failed, oversize = self._produce(items)
            if failed:
                return False
            path.unlink(missing_ok=True)
            self._stats.replayed += len(items) - oversize
            self._stats.spool_records -= len(items)
        return True
