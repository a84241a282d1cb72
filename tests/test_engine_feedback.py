"""Feedback emission against a real Tansu broker that is DOWN while requests are served and comes
up later: every finished request's record arrives in `adaflash.feedback.raw` exactly once after
dedupe by record id, keyed by tenant, with its rounds and latency."""

from __future__ import annotations

import time

import httpx
import pytest

from adaflash.feedback.broker import Broker, free_port
from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
from adaflash.feedback.schema import parse_record
from adaflash.feedback.topics import RAW
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.feedback_emitter import FeedbackEmitter
from adaflash.serving.server import ServerSettings, ServerThread, create_app
from tests.conftest import make_bundle


def _consume_all(bootstrap: str, expect: int, timeout: float = 60.0) -> list:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000)
    try:
        parts = [TopicPartition(RAW, p) for p in sorted(consumer.partitions_for_topic(RAW) or [])]
        consumer.assign(parts)  # no group join: assign() is immediate (joins take seconds)
        consumer.seek_to_beginning(*parts)
        messages, seen = [], set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                for m in batch:
                    messages.append(m)
                    seen.add(parse_record(m.value).record_id)
            if len(seen) >= expect:
                # Drain a little longer so a duplicate delivered late would be seen too.
                for batch in consumer.poll(timeout_ms=1000).values():
                    messages.extend(batch)
                break
        return messages
    finally:
        consumer.close()


@pytest.mark.timeout(240)
def test_records_arrive_exactly_once_after_broker_outage(tiny64, tmp_path):
    broker = Broker(tmp_path / "broker", port=free_port())
    producer = FeedbackProducer(
        ProducerConfig(
            bootstrap_servers=broker.bootstrap_servers, spool_dir=tmp_path / "spool", retry_seconds=0.5
        )
    )
    engine = Engine(tiny64, make_bundle(tiny64, block_size=4), EngineConfig(method="adaflash"), "A")
    emitter = FeedbackEmitter(engine, producer)
    engine.start()
    srv = ServerThread(create_app(engine, ServerSettings()), port=free_port()).start()
    try:
        served: dict[str, dict] = {}
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for i in range(12):
                headers = {"X-Tenant-Id": f"tenant-{i % 3}"} if i % 4 else {}
                if i == 5:
                    headers["X-Feedback-Consent"] = "false"
                body = {
                    "prompt": f"record {i}",
                    "max_tokens": 12 + i,
                    "temperature": 0,
                    "user": "from-user-field",
                }
                # Every method serving offers emits feedback, adaflash-cost's mixed rounds included.
                method = "ar" if i % 2 else ("adaflash", "adaflash-cost", "ngram")[i // 2 % 3]
                body["method"] = method
                r = c.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 200
                served[r.json()["id"].removeprefix("cmpl-")] = {
                    "tenant": headers.get("X-Tenant-Id", "from-user-field"),
                    "consent": i != 5,
                    "tokens": r.json()["choices"][0]["token_ids"],
                    "method": method,
                }
        # Broker down: the step loop kept serving; the records wait in the on-disk spool.
        deadline = time.monotonic() + 60
        while producer.stats["spooled"] < len(served) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert producer.stats["spooled"] == len(served) and producer.stats["sent"] == 0
        assert producer.spool_bytes() > 0

        broker.start()  # comes up later (and creates the topics)
        deadline = time.monotonic() + 90
        while producer.stats["replayed"] < len(served) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert producer.stats["replayed"] == len(served) and producer.spool_bytes() == 0

        messages = _consume_all(broker.bootstrap_servers, len(served))
        records = {}
        for m in messages:
            rec = parse_record(m.value)
            records.setdefault(rec.record_id, (m, rec))
        assert len(records) == len(served)  # exactly once after dedupe by record id
        by_request = {rec.request_id: (m, rec) for m, rec in records.values()}
        assert set(by_request) == set(served)
        for rid, want in served.items():
            m, rec = by_request[rid]
            assert m.key == want["tenant"].encode() and rec.tenant_id == want["tenant"]
            assert rec.consent is want["consent"] and rec.method == want["method"]
            assert rec.output_token_ids == want["tokens"] and rec.target_fingerprint == tiny64.fingerprint
            assert rec.drafter_version == ("A" if want["method"] not in ("ar", "ngram") else None)
            assert rec.block_size == (4 if want["method"] != "ar" else 1)
            starts = [rd.start for rd in rec.rounds]
            assert starts[0] == 0 and all(
                b == a.start + a.accepted + 1 for a, b in zip(rec.rounds, starts[1:], strict=False)
            )
            assert all(1 <= rd.verify_len <= rec.block_size for rd in rec.rounds)
            if want["method"] in ("ar", "adaflash"):
                assert {rd.proposer for rd in rec.rounds} == {"none" if want["method"] == "ar" else "drafter"}
            assert rec.latency.ttft_ms > 0 and len(rec.latency.itl_ms) == len(rec.output_token_ids) - 1
            assert rec.prompt_text.startswith("record ")
    finally:
        srv.stop()
        engine.stop()
        emitter.close(timeout=10)
        broker.stop()
