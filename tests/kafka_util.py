"""Helpers for tests that run a real Tansu broker (started and stopped by the test)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from adaflash.feedback.broker import Broker, free_port


@contextlib.contextmanager
def running_broker(state_dir: Path, port: int | None = None) -> Iterator[Broker]:
    broker = Broker(state_dir, port=port or free_port())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def read_topic(bootstrap: str, topic: str, timeout: float = 30.0) -> list:
    """Every message currently in `topic` (all partitions, from the beginning)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        out = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < end[tp] for tp in parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end in {timeout}s")
            for msgs in consumer.poll(timeout_ms=500).values():
                out.extend(msgs)
        return out
    finally:
        consumer.close()


def produce(bootstrap: str, topic: str, items: list[tuple[bytes | None, bytes]]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    futures = [producer.send(topic, key=k, value=v) for k, v in items]
    producer.flush()
    for f in futures:
        f.get(timeout=30)
    producer.close()
