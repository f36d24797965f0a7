"""The local runner's Kafka: a real three-node KRaft quorum that survives losing a node, and a start that
survives a node exiting on a slow machine, or fails naming it and leaves nothing behind."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from postbox.relay.devstack.kafka import KafkaStartError, LocalKafka
from tests.support.kafka import create_topic, read_topic


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


def _wrapper(tmp_path: Path, body: str) -> list[str]:
    """A command prefix for the nodes' java commands: runs `body` (sh) first, then the command."""
    script = tmp_path / "wrapper.sh"
    script.write_text(
        f'#!/bin/sh\ncase "$*" in\n  *kafka.Kafka*node1/server.properties*) {body} ;;\nesac\nexec "$@"\n'
    )
    script.chmod(0o755)
    return [str(script)]


def test_a_node_that_exits_during_the_start_is_started_again(tmp_path: Path) -> None:
    marker = tmp_path / "exited-once"
    kafka = LocalKafka(command_prefix=_wrapper(tmp_path, f"[ -e {marker} ] || {{ touch {marker}; exit 3; }}"))
    try:
        kafka.start()
        assert marker.exists(), "the node's first start did not exit, so nothing was tested"
        topic = f"restarted-{uuid.uuid4().hex[:6]}"
        create_topic(kafka.bootstrap, topic, 1)
        producer = Producer({"bootstrap.servers": kafka.bootstrap, "acks": "all"})
        producer.produce(topic, b"after a restart")
        assert producer.flush(30) == 0
        assert [r.value for r in read_topic(kafka.bootstrap, topic, expected=1)] == [b"after a restart"]
    finally:
        kafka.stop()


def test_a_failed_start_names_the_node_stops_the_others_and_removes_their_directories(tmp_path: Path) -> None:
    kafka = LocalKafka(nodes_count=2, command_prefix=_wrapper(tmp_path, "echo refusing to start; exit 3"))
    exited = r"(?s)Kafka node 1 exited during its start \(exit codes \[3, 3, 3\], 2 restarts\).*refusing to"
    with pytest.raises(KafkaStartError, match=exited):
        kafka.start()
    other = kafka.nodes[1].process
    assert other is not None, "node 2 was never started, so its stop was not tested"
    assert other.poll() is not None, "node 2 still runs after the failed start"
    assert not kafka.base_dir.exists()
