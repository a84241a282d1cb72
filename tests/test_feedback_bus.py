"""Feedback schema, the embedded broker and the spooling producer — against a real Tansu process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from adaflash.feedback import topics
from adaflash.feedback.broker import Broker, free_port, port_open
from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
from adaflash.feedback.schema import FeedbackRecord, SchemaError, parse_record
from tests.kafka_util import read_topic, running_broker


def _record(i: int, tenant: str = "acme") -> FeedbackRecord:
    return FeedbackRecord(
        request_id=f"req-{i}",
        tenant_id=tenant,
        target_fingerprint="fp",
        method="ar",
        block_size=1,
        prompt_text="hi",
        output_text="ok",
        prompt_token_ids=[104, 105],
        output_token_ids=[111, 107],
    )


def test_schema_round_trip_and_rejections():
    rec = _record(0)
    assert parse_record(rec.to_bytes()) == rec
    with pytest.raises(SchemaError, match="not JSON"):
        parse_record(b"{oops")
    data = json.loads(rec.to_bytes())
    data["schema_version"] = 2
    with pytest.raises(SchemaError, match="unknown schema_version 2"):
        parse_record(json.dumps(data))
    data = json.loads(rec.to_bytes())
    del data["tenant_id"]
    with pytest.raises(SchemaError, match="tenant_id"):
        parse_record(json.dumps(data))
    data = json.loads(rec.to_bytes())
    data["surprise"] = 1  # a newer producer must bump the version, not add fields silently
    with pytest.raises(SchemaError, match="surprise"):
        parse_record(json.dumps(data))


def test_broker_lifecycle_creates_topics(tmp_path):
    from kafka import KafkaAdminClient

    broker = Broker(tmp_path / "broker", port=free_port())
    assert not broker.status()["running"]
    st = broker.start()
    try:
        assert st["running"] and st["pid"]
        assert broker.start()["pid"] == st["pid"]  # idempotent: a second start finds the first
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap_servers)
        assert {t.name for t in topics.TOPICS} <= set(admin.list_topics())
        admin.close()
    finally:
        assert broker.stop()
    assert not broker.status()["running"]
    assert not port_open(broker.host, broker.port)
    assert not broker.stop()  # nothing left to stop


def test_broker_cli(tmp_path):
    env = {**os.environ, "ADAFLASH_HOME": str(tmp_path)}
    port = str(free_port())
    cli = [sys.executable, "-m", "adaflash.cli", "broker"]
    out = subprocess.run([*cli, "start", "--port", port], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    try:
        st = subprocess.run(
            [*cli, "status", "--port", port], env=env, capture_output=True, text=True, timeout=60
        )
        assert st.returncode == 0
        assert topics.RAW in st.stdout
    finally:
        stop = subprocess.run(
            [*cli, "stop", "--port", port], env=env, capture_output=True, text=True, timeout=60
        )
    assert "broker stopped" in stop.stdout
    down = subprocess.run(
        [*cli, "status", "--port", port], env=env, capture_output=True, text=True, timeout=60
    )
    assert down.returncode == 1


def test_producer_spools_while_broker_down_then_replays_exactly_once(tmp_path):
    port = free_port()
    spool = tmp_path / "spool"
    producer = FeedbackProducer(
        ProducerConfig(bootstrap_servers=f"127.0.0.1:{port}", spool_dir=spool, retry_seconds=0.5)
    )
    records = [_record(i, tenant=f"t{i % 3}") for i in range(40)]
    for r in records[:25]:
        producer.send(r)  # broker not started yet
    assert producer.flush(timeout=30)
    segments = list(spool.glob("spool-*.jsonl"))
    assert segments and producer.stats["spooled"] == 25
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segments)  # raw text: owner only
    with running_broker(tmp_path / "broker", port=port) as broker:
        for r in records[25:]:
            producer.send(r)
        deadline = time.monotonic() + 60
        while (producer.stats["spool_bytes"] or producer.stats["queued"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert producer.flush(timeout=30)
        producer.close()
        msgs = read_topic(broker.bootstrap_servers, topics.RAW)
    ids = [parse_record(m.value).record_id for m in msgs]
    assert set(ids) == {r.record_id for r in records}  # nothing lost...
    assert len(set(ids)) == len(records)  # ...and after dedupe by id, each exactly once
    assert not list(spool.glob("spool-*.jsonl"))  # replayed segments are deleted
    keys = {m.key.decode() for m in msgs}
    assert keys == {"t0", "t1", "t2"}  # keyed by tenant


def test_spool_is_bounded(tmp_path):
    producer = FeedbackProducer(
        ProducerConfig(
            bootstrap_servers=f"127.0.0.1:{free_port()}",
            spool_dir=tmp_path,
            max_spool_bytes=2000,
            retry_seconds=5,
        )
    )
    for i in range(30):
        producer.send(_record(i))
    assert producer.flush(timeout=30)
    st = producer.stats
    producer.close()
    assert st["spool_bytes"] <= 2000
    assert st["spool_dropped"] > 0 and st["spooled"] + st["spool_dropped"] == 30
