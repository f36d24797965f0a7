"""The servers the suite runs on are real: a message through the broker, a row through the database."""

from __future__ import annotations

import uuid

import psycopg
from confluent_kafka import Producer

from tests.support.kafka import read_topic
from tests.support.servers import Servers


def test_one_message_round_trips_through_the_real_broker(servers: Servers) -> None:
    topic = f"smoke-{uuid.uuid4().hex[:8]}"
    producer = Producer(
        {"bootstrap.servers": servers.kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    reports: list[object] = []
    producer.produce(
        topic, b"hello", b"key-1", headers=[("id", b"42")], on_delivery=lambda err, msg: reports.append(err)
    )
    producer.flush(30)
    assert reports == [None]

    [record] = read_topic(servers.kafka_bootstrap, topic, expected=1)
    assert (record.key, record.value, record.headers) == (b"key-1", b"hello", {"id": b"42"})


def test_one_row_round_trips_through_the_real_database(servers: Servers) -> None:
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        assert version is not None
        assert int(str(version[0])) >= 150000
        conn.execute("CREATE TEMP TABLE smoke (id int PRIMARY KEY, body jsonb)")
        conn.execute("INSERT INTO smoke VALUES (1, %s::jsonb)", ['{"a": [1, "two"]}'])
        assert conn.execute("SELECT body FROM smoke WHERE id = 1").fetchone() == ({"a": [1, "two"]},)
