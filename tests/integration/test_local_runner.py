"""The local runner's optional three-node Kafka: a real KRaft quorum that survives losing a node."""

from __future__ import annotations

import uuid

from confluent_kafka import Producer

from postbox.relay.devstack.kafka import LocalKafka
from tests.support import create_topic, read_topic


def test_a_three_node_cluster_keeps_taking_acks_all_writes_with_a_node_down() -> None:
    kafka = LocalKafka(nodes_count=3).start()
    try:
        topic = f"quorum-{uuid.uuid4().hex[:6]}"
        create_topic(kafka.bootstrap, topic, 3, replication=3)
        producer = Producer(
            {
                "bootstrap.servers": kafka.bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "message.timeout.ms": 30000,
            }
        )
        failures: list[object] = []

        def send(n: int, tag: str) -> None:
            for i in range(n):
                producer.produce(
                    topic,
                    f"{tag}-{i}".encode(),
                    f"k{i}".encode(),
                    on_delivery=lambda err, _m: failures.append(err) if err else None,
                )
            assert producer.flush(60) == 0

        send(50, "before")
        kafka.stop_node(kafka.nodes[2], kill=True)  # replication 3, min.insync 2: one node may go
        send(50, "during")
        kafka.start_node(kafka.nodes[2])
        assert failures == []
        values = sorted((r.value or b"").decode() for r in read_topic(kafka.bootstrap, topic, expected=100))
        assert len(values) == 100
        assert sum(v.startswith("during") for v in values) == 50
    finally:
        kafka.stop()
