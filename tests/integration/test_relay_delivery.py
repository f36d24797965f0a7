"""The relay against a real PostgreSQL and Kafka: what lands on the topic, keyed and id'd how."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import psycopg

from relay.outbox import OutboxEvent, enqueue, enqueue_many
from tests.servers import Servers
from tests.support import RelayProcess, read_topic, wait_until


def pending_count(db: psycopg.Connection[tuple[object, ...]]) -> int:
    row = db.execute("SELECT count(*) FROM outbox WHERE state = 'pending'").fetchone()
    assert row is not None
    return int(str(row[0]))


def test_every_row_published_once_with_debezium_key_id_and_topic(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    aggregate_type = f"order{uuid.uuid4().hex[:6]}"
    events = [
        OutboxEvent(
            aggregate_type,
            f"agg-{i % 17}",
            "OrderPlaced",
            {"n": i, "text": "é ✓"},
            headers={"traceparent": f"00-{i:032x}-{i:016x}-01"},
        )
        for i in range(300)
    ]
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(app, events[:200], schema=schema)
        ids.append(enqueue(app, aggregate_type, "single", "OrderPlaced", {"n": "single"}, schema=schema))
        ids += enqueue_many(app, events[200:], schema=schema)
        app.commit()

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "64") as relay:
        wait_until(lambda: pending_count(db) == 0, 60, what="outbox drained")
        assert relay.terminate() == 0

    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(ids))
    seen = Counter(r.headers["id"].decode() for r in records)
    assert seen == Counter(str(i) for i in ids), "each event exactly once in the happy path"
    by_id = {r.headers["id"].decode(): r for r in records}
    for event_id, event in zip(ids[:200], events[:200], strict=True):
        record = by_id[str(event_id)]
        assert record.key == event.aggregate_id.encode()
        assert json.loads(record.value or b"") == event.payload
        assert record.headers["traceparent"] == event.headers["traceparent"].encode()
    states = db.execute(
        "SELECT state, count(*), min(attempts), max(attempts) FROM outbox GROUP BY state"
    ).fetchall()
    assert states == [("published", len(ids), 1, 1)]
