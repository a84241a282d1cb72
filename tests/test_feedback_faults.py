"""No silent loss on the feedback path (issue 14): a broker that shuts down gracefully (SIGTERM)
keeps acknowledging sends on open connections while it refuses new ones, then exits with its
memory-only topics. Every record sent after the fault must still arrive — spooled, replayed and,
after dedupe by record id, exactly once — and the producer's counts are in /metrics."""

from __future__ import annotations

import errno
import os
import signal
import time

import httpx

from adaflash.feedback import topics
from adaflash.feedback.broker import Broker, free_port
from adaflash.feedback.producer import FeedbackProducer, ProducerConfig, broker_answers
from adaflash.feedback.schema import parse_record
from adaflash.procs import alive
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.server import ServerSettings, ServerThread, create_app
from tests.kafka_util import read_topic, running_broker
from tests.test_feedback_bus import _record


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_records_sent_after_a_sigtermed_broker_arrive_exactly_once(tmp_path):
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    producer = FeedbackProducer(ProducerConfig(bootstrap, tmp_path / "spool", retry_seconds=0.3))
    before, after = [_record(i) for i in range(10)], [_record(100 + i) for i in range(32)]
    broker = Broker(tmp_path / "broker", port=port)
    broker.start()
    try:
        assert broker_answers(bootstrap)
        for r in before:
            producer.send(r)
        assert producer.flush(30) and producer.stats["sent"] == len(before)
        pid = broker._pid()
        os.kill(pid, signal.SIGTERM)  # graceful: open connections keep being served for a while
        _wait(lambda: not broker_answers(bootstrap), 10, "the broker kept taking new connections")
        for r in after:
            producer.send(r)
            time.sleep(0.02)
        assert producer.flush(60)
        st = producer.stats
        assert st["sent"] == len(before) and st["spooled"] == len(after) == st["spool_records"]
        _wait(lambda: not alive(pid), 30, "the SIGTERMed broker did not exit")
    finally:
        broker.stop()
    # The broker comes back (empty: what it held is the memory-only broker's loss, counted apart).
    with running_broker(tmp_path / "broker", port=port) as broker:
        _wait(lambda: producer.stats["spool_records"] == 0, 60, "the spool was not replayed")
        producer.close()
        msgs = read_topic(broker.bootstrap_servers, topics.RAW)
    ids = [parse_record(m.value).record_id for m in msgs]
    assert {r.record_id for r in after} <= set(ids)  # every record sent after the fault arrived...
    assert len(set(ids)) == len(ids)  # ... exactly once
    st = producer.stats
    assert st["replayed"] == len(after) and st["spool_dropped"] == 0


def test_records_sent_to_a_killed_broker_are_replayed_when_it_returns(tmp_path):
    """SIGKILL: connections reset at once, nothing is acknowledged; every record sent while the
    broker is gone is spooled and arrives exactly once when a broker is back on the address."""
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    producer = FeedbackProducer(ProducerConfig(bootstrap, tmp_path / "spool", retry_seconds=0.3))
    after = [_record(200 + i) for i in range(24)]
    broker = Broker(tmp_path / "broker", port=port)
    broker.start()
    try:
        producer.send(_record(0))
        assert producer.flush(30) and producer.stats["sent"] == 1
        pid = broker._pid()
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: not alive(pid), 10, "the SIGKILLed broker is still alive")
        t0 = time.monotonic()
        for r in after:
            producer.send(r)  # the serving path never waits for the broker
        assert time.monotonic() - t0 < 1.0
        assert producer.flush(60)
        assert producer.stats["spool_records"] == len(after)
    finally:
        broker.stop()
    with running_broker(tmp_path / "broker", port=port) as broker:
        _wait(lambda: producer.stats["spool_records"] == 0, 60, "the spool was not replayed")
        producer.close()
        ids = [parse_record(m.value).record_id for m in read_topic(broker.bootstrap_servers, topics.RAW)]
    assert sorted(ids) == sorted(r.record_id for r in after)
    assert producer.stats["replayed"] == len(after) and producer.stats["spool_dropped"] == 0


def test_a_frozen_broker_neither_blocks_serving_nor_loses_records(tmp_path):
    """SIGSTOP: the kernel still completes TCP handshakes, but nothing answers. Sends must not
    block the caller; unacknowledged records are spooled and replayed after SIGCONT. A request
    the frozen broker had already read may be acknowledged late as well: consumers dedupe by
    record id, so every record arrives, once after dedupe."""
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    producer = FeedbackProducer(ProducerConfig(bootstrap, tmp_path / "spool", retry_seconds=0.3))
    frozen = [_record(300 + i) for i in range(16)]
    with running_broker(tmp_path / "broker", port=port) as broker:
        producer.send(_record(1))
        assert producer.flush(30)
        pid = broker._pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(lambda: not broker_answers(bootstrap), 10, "a frozen broker answered")
            t0 = time.monotonic()
            for r in frozen:
                producer.send(r)
            assert time.monotonic() - t0 < 1.0
            _wait(lambda: producer.stats["spool_records"] >= len(frozen), 60, "records were not spooled")
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(lambda: producer.stats["spool_records"] == 0, 60, "the spool was not replayed after SIGCONT")
        producer.close()
        ids = [parse_record(m.value).record_id for m in read_topic(broker.bootstrap_servers, topics.RAW)]
    assert {r.record_id for r in frozen} <= set(ids)
    assert producer.stats["spool_dropped"] == 0


def test_feedback_counts_and_spool_depth_are_in_metrics(tmp_path, tiny64):
    port = free_port()
    producer = FeedbackProducer(ProducerConfig(f"127.0.0.1:{port}", tmp_path / "spool", retry_seconds=0.3))
    engine = Engine(tiny64, None, EngineConfig(method="ar"))
    srv = ServerThread(create_app(engine, ServerSettings(), feedback=producer), port=free_port()).start()
    try:
        for i in range(5):
            producer.send(_record(i))  # no broker yet: spooled
        assert producer.flush(30)
        m = httpx.get(srv.url + "/metrics").text
        assert 'adaflash_feedback_records_total{outcome="spooled"} 5.0' in m
        assert 'adaflash_feedback_records_total{outcome="sent"} 0.0' in m
        assert "adaflash_feedback_spool_records 5.0" in m
        with running_broker(tmp_path / "broker", port=port):
            _wait(lambda: producer.stats["spool_records"] == 0, 60, "the spool was not replayed")
            producer.send(_record(9))
            assert producer.flush(30)
            m = httpx.get(srv.url + "/metrics").text
        for line in (
            'adaflash_feedback_records_total{outcome="replayed"} 5.0',
            'adaflash_feedback_records_total{outcome="sent"} 1.0',
            'adaflash_feedback_records_total{outcome="dropped"} 0.0',
            "adaflash_feedback_spool_records 0.0",
        ):
            assert line in m, line
    finally:
        srv.stop()
        producer.close()


def _full_disk(producer: FeedbackProducer, failures: int | None):
    """Fault injection: the next `failures` spool writes (every one: None) fail with ENOSPC."""
    write, left = producer._write_segment, [failures]

    def write_segment(path, lines):
        if left[0] is None or left[0] > 0:
            if left[0] is not None:
                left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, lines)

    return write_segment


def test_a_full_disk_does_not_end_feedback_and_health_says_degraded(tmp_path, tiny64, monkeypatch):
    """ENOSPC on the spool while the broker is down: the producer holds the records in memory,
    backs off, says so in /health (200, degraded) and /metrics, and writes them when space
    returns; once the broker is back, every record accepted arrives. It used to kill the producer
    thread: 0 records delivered, /health 200 ok, nothing counted as dropped."""
    port = free_port()
    producer = FeedbackProducer(ProducerConfig(f"127.0.0.1:{port}", tmp_path / "spool", retry_seconds=0.3))
    monkeypatch.setattr(producer, "_write_segment", _full_disk(producer, failures=3))
    engine = Engine(tiny64, None, EngineConfig(method="ar"))
    srv = ServerThread(create_app(engine, ServerSettings(), feedback=producer), port=free_port()).start()
    records = [_record(500 + i) for i in range(30)]
    try:
        for r in records[:10]:
            producer.send(r)  # broker down and the disk full: held in memory
        _wait(
            lambda: httpx.get(srv.url + "/health").json()["status"] == "degraded", 10, "/health not degraded"
        )
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 200 and "No space left" in health.json()["feedback"]["degraded"]
        m = httpx.get(srv.url + "/metrics").text
        assert "adaflash_feedback_degraded 1.0" in m and "adaflash_feedback_spool_write_errors_total 1.0" in m
        for r in records[10:20]:
            producer.send(r)
        # Space returns after three failed writes: everything held reaches the spool.
        _wait(lambda: producer.stats["spool_records"] == 20, 30, "held records were not spooled")
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert producer.stats["spool_write_errors"] == 3 and producer.stats["held"] == 0
        with running_broker(tmp_path / "broker", port=port) as broker:
            for r in records[20:]:
                producer.send(r)
            _wait(lambda: producer.stats["spool_records"] == 0, 60, "the spool was not replayed")
            assert producer.flush(30)
            producer.close()
            ids = [parse_record(m.value).record_id for m in read_topic(broker.bootstrap_servers, topics.RAW)]
    finally:
        srv.stop()
        producer.close()
    assert sorted(set(ids)) == sorted(r.record_id for r in records)
    st = producer.stats
    assert st["dropped"] == 0 and st["sent"] + st["replayed"] == len(records)


def test_records_the_disk_never_takes_are_counted_as_dropped(tmp_path, monkeypatch):
    """A disk that stays full and no broker: the in-memory hold is bounded; whatever it cannot
    keep (and whatever is still held at close) is counted as dropped, never silently lost."""
    cfg = ProducerConfig(
        f"127.0.0.1:{free_port()}", tmp_path / "spool", retry_seconds=0.1, max_held_records=5
    )
    producer = FeedbackProducer(cfg)
    monkeypatch.setattr(producer, "_write_segment", _full_disk(producer, failures=None))
    for i in range(12):
        producer.send(_record(600 + i))
    assert producer.flush(30)
    st = producer.stats
    assert st["held"] == 5 and st["dropped"] == 7 and st["degraded"]
    producer.close()
    st = producer.stats
    assert st["held"] == 0 and st["dropped"] == 12 and st["sent"] == st["spooled"] == 0


def test_a_record_past_the_size_limit_is_dropped_and_the_next_one_still_arrives(tmp_path):
    """An oversized record (a client-sized label, a huge prompt) is refused by the Kafka client on
    every try: spooled, it would fail every replay and hold every later record behind it. It is
    dropped and counted; the records around it arrive."""
    with running_broker(tmp_path / "broker") as broker:
        producer = FeedbackProducer(ProducerConfig(broker.bootstrap_servers, tmp_path / "spool"))
        first, last = _record(1), _record(2)
        try:
            producer.send(first)
            producer.send_raw(b"acme", b"x" * (2 * 2**20))  # past kafka-python's 1 MB max_request_size
            producer.send(last)
            assert producer.flush(30)
            st = producer.stats
            assert st["oversize_dropped"] == 1 and st["dropped"] == 1
            assert st["sent"] == 2 and st["spool_records"] == 0 and st["spooled"] == 0
        finally:
            producer.close()
        ids = [parse_record(m.value).record_id for m in read_topic(broker.bootstrap_servers, topics.RAW)]
    assert sorted(ids) == sorted([first.record_id, last.record_id])
