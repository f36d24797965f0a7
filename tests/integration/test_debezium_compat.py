"""postbox's default wire format against a real Debezium: the same outbox rows, read once by Debezium's
PostgreSQL connector with its outbox event router (Kafka Connect standalone, Maven Central jars) and once
by the postbox relay, must give the same messages: key, value and `id` header byte for byte, the same
partition, and the same order per aggregate. A consumer written for Debezium then works unchanged.
"""

from __future__ import annotations

import uuid

import psycopg

from postbox.relay.devstack.postgres import LocalPostgres
from postbox.relay.outbox import enqueue
from tests.debezium import DebeziumConnect, outbox_router_options
from tests.support.kafka import Record, create_topic, read_topic
from tests.support.modes import BOTH_MODES
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

SCHEMA = "postbox"
PARTITIONS = 6

# Payloads that a JSON library could render differently: key order, spacing, unicode, escapes, numbers,
# nesting, and a JSON value that is not an object.
PAYLOADS: list[object] = [
    {"b": 1, "a": 2, "nested": {"z": [1, 2, {"y": None}], "x": True}},
    {"text": 'café ☕ 𝄞 "quoted" back\\slash\ttab\nnewline', "emoji": "👍🏽"},
    {"int": 12345678901234567890, "float": 1.5e-7, "neg": -0.0, "exp": 1e100, "dec": 10.10},
    {"empty": {}, "list": [], "spaces": "  a  b  "},
    ["a", 1, None],
    "just a string",
    {"html": "<b>&amp;</b>", "unicode_escape": "\u00e9\u0000".replace("\u0000", "")},
]


def by_event_id(records: list[Record]) -> dict[bytes, Record]:
    return {r.headers["id"]: r for r in records}


@BOTH_MODES
def test_postbox_messages_match_debezium_outbox_router_byte_for_byte(
    servers: Servers, logical_postgres: LocalPostgres
) -> None:
    aggregate_type = f"compat{uuid.uuid4().hex[:6]}"
    postbox_topic = f"outbox.event.{aggregate_type}"
    debezium_topic = f"debezium.{aggregate_type}"
    for topic in (postbox_topic, debezium_topic):
        create_topic(servers.kafka_bootstrap, topic, PARTITIONS)

    debezium = DebeziumConnect(
        logical_postgres.dsn,
        logical_postgres.port,
        servers.kafka_bootstrap,
        outbox_router_options(SCHEMA, topic_replacement="debezium.${routedByValue}"),
        heap="512M",
    )
    try:
        wait_until(lambda: debezium.streaming(logical_postgres.dsn), 180, interval=0.5, what="Debezium up")
        written: list[bytes] = []  # event ids in commit order
        with psycopg.connect(logical_postgres.dsn) as app:
            for i in range(60):
                aggregate = f"agg-{i % 7}-ü"
                payload = PAYLOADS[i % len(PAYLOADS)]
                written.append(
                    str(enqueue(app, aggregate_type, aggregate, "Changed", payload, schema=SCHEMA)).encode()
                )
                if i % 5 == 0:
                    app.commit()  # several transactions, some with several rows
            app.commit()
        from_debezium = read_topic(servers.kafka_bootstrap, debezium_topic, expected=60)
    finally:
        debezium.close(logical_postgres.dsn)

    with RelayProcess(logical_postgres.dsn, servers.kafka_bootstrap, SCHEMA):
        from_postbox = read_topic(servers.kafka_bootstrap, postbox_topic, expected=60)

    assert len(from_debezium) == len(from_postbox) == 60
    debezium_by_id, postbox_by_id = by_event_id(from_debezium), by_event_id(from_postbox)
    assert debezium_by_id.keys() == postbox_by_id.keys()
    for event_id, theirs in debezium_by_id.items():
        ours = postbox_by_id[event_id]
        assert ours.key == theirs.key, event_id
        assert ours.value == theirs.value, (event_id, ours.value, theirs.value)
        assert ours.partition == theirs.partition, "the same key must land on the same partition"
        assert set(ours.headers) == {"id", "eventType"}
        # Debezium 3 also adds its own `__debezium.context.*` diagnostics headers; the contract is `id`
        # and, with the usual additional-placement option, `eventType`.
        assert {h for h in theirs.headers if not h.startswith("__debezium.")} == {"id", "eventType"}
        assert ours.headers["eventType"] == theirs.headers["eventType"] == b"Changed"
    assert sorted(debezium_by_id) == sorted(written)
    for records in (from_debezium, from_postbox):
        per_key: dict[bytes | None, list[int]] = {}
        for record in sorted(records, key=lambda r: (r.partition, r.offset)):
            per_key.setdefault(record.key, []).append(written.index(record.headers["id"]))
        assert all(order == sorted(order) for order in per_key.values()), "per-aggregate order"
