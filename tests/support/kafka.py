"""Kafka as the tests see it: create_topic, produce and produce_with_headers (messages as the relay would
send them, or with exactly the headers given), and read_topic (every Record of a topic, from the start)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.support.waiting import wait_until


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


def read_topic(
    bootstrap: str,
    topic: str,
    expected: int,
    timeout: float = 60.0,
    settle: float = 1.0,
    isolation: str = "read_committed",
) -> list[Record]:
    """Every message of `topic` from the beginning: waits for `expected`, then `settle` seconds for extras.
    `isolation`: librdkafka's default, read_committed (aborted transactions' messages are skipped), or
    read_uncommitted (the Java client's default: every message written)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wait_until(lambda: topic in admin.list_topics(timeout=5).topics, timeout, what=f"topic {topic}")
    partitions = admin.list_topics(topic, timeout=5).topics[topic].partitions
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": isolation,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            if settle_until is None and len(records) >= expected:
                settle_until = time.monotonic() + settle
            if settle_until is not None and time.monotonic() >= settle_until:
                break
            for m in consumer.consume(500, timeout=0.2):
                if m.error():
                    continue
                records.append(
                    Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), dict(m.headers() or []))
                )
    finally:
        consumer.close()
    return records


def produce(
    bootstrap: str, topic: str, messages: list[tuple[str, str, dict[str, object]]], key: str | None = None
) -> None:
    """(message id, event type, payload) triples, as the relay would send them (plus an eventType header)."""
    import json  # noqa: PLC0415

    from confluent_kafka import Producer  # noqa: PLC0415

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
        }
    )
    errors: list[object] = []
    for message_id, event_type, payload in messages:
        producer.produce(
            topic,
            json.dumps(payload).encode(),
            (key or str(payload.get("account", "k"))).encode(),
            headers=[("id", message_id.encode()), ("eventType", event_type.encode())],
            on_delivery=lambda err, _m: errors.append(err) if err else None,
        )
    assert producer.flush(30) == 0
    assert not errors, errors


def create_topic(
    bootstrap: str, topic: str, partitions: int, replication: int = 1, config: dict[str, str] | None = None
) -> None:
    from confluent_kafka.admin import NewTopic  # noqa: PLC0415

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the future resolves
    admin.create_topics([NewTopic(topic, partitions, replication, config=config or {})])[topic].result(30)


def produce_with_headers(
    bootstrap: str, topic: str, value: bytes, key: bytes, headers: list[list[tuple[str, bytes]]]
) -> None:
    """One record per entry of `headers`, each with exactly those headers (hostile ones too), in order."""
    from confluent_kafka import Producer  # noqa: PLC0415

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for record_headers in headers:
        producer.produce(topic, value, key, headers=record_headers)
    assert producer.flush(30) == 0
