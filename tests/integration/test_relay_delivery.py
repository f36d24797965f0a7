"""The relay against a real PostgreSQL and Kafka: what lands on the topic, keyed and id'd how, from either
source (the outbox read as a log and as a queue)."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import psycopg

from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_many
from tests.support.database import outbox_states
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES
from tests.support.probes import http_get, metric_value
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

pytestmark = BOTH_MODES


def test_every_row_published_once_with_debezium_key_id_and_topic(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]], relay_mode: str
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
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": len(ids)},
            60,
            what="outbox drained",
        )
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
    if relay_mode == "queue":  # each row marked published after one attempt
        assert states == [("published", len(ids), 1, 1)]
    else:  # log mode writes nothing to a row it publishes
        assert states == [("logged", len(ids), 0, 0)]


def test_each_batch_reports_its_stages_in_order_and_every_row_is_timed(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The stage histograms and the debug line per batch (which tests/bench's latency breakdown reads)."""
    aggregate_type = f"order{uuid.uuid4().hex[:6]}"
    with psycopg.connect(servers.database_url) as app:
        enqueue_many(
            app, [OutboxEvent(aggregate_type, f"a{i}", "Placed", {"n": i}) for i in range(150)], schema=schema
        )
        app.commit()
    row_ids = {int(str(r[0])) for r in db.execute("SELECT id FROM outbox").fetchall()}

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "50") as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 150},
            60,
            what="outbox drained",
        )
        _, metrics = http_get(relay.metrics_port, "/metrics")
        assert relay.terminate() == 0

    batches = [json.loads(line) for line in relay.log().splitlines() if '"relay_batch_published"' in line]
    timed = Counter(row_id for batch in batches for row_id in batch["row_ids"])
    assert set(timed) == row_ids, "every row is in one batch's line"
    assert set(timed.values()) == {1}
    for batch in batches:
        stages = [batch[k] for k in ("claim_started_at", "claimed_at", "acked_at", "committed_at")]
        assert stages == sorted(stages), batch
        assert batch["woke_at"] <= batch["claim_started_at"]
    assert metric_value(metrics, "postbox_relay_commit_to_ack_seconds_count") == 150
    for stage in ("claim", "publish", "mark"):
        assert metric_value(metrics, "postbox_relay_batch_stage_seconds_count", stage=stage) == len(batches)
