"""The outbox's partitions by txid (migration 0007) under concurrent writers: partitions created, emptied
and dropped all the while, with no writer ever refused and no row still to publish ever emptied."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import psycopg

from postbox.relay.core.db import connect
from postbox.relay.outbox import OutboxEvent, enqueue_many
from postbox.relay.outbox.admin import PartitionUpkeep, maintain_partitions
from tests.support.delivery import check_delivery
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES
from tests.support.processes import RelayProcess
from tests.support.servers import Servers

Conn = psycopg.Connection[tuple[object, ...]]
WIDTH = 16  # txids per partition: each writer's transactions fill one in a moment


def _write(
    database_url: str,
    schema: str,
    aggregate_type: str,
    writer: int,
    stop: threading.Event,
    written: dict[str, tuple[str, int]],
    errors: list[BaseException],
) -> None:
    """One event per transaction (a txid each), until stopped; every refusal is kept for the test."""
    seq = 0
    try:
        with psycopg.connect(database_url) as app:
            while not stop.is_set():
                aggregate = f"w{writer}-{seq % 4}"
                event = OutboxEvent(aggregate_type, aggregate, "Changed", {"seq": seq})
                [event_id] = enqueue_many(app, [event], schema=schema)
                app.commit()
                written[str(event_id)] = (aggregate, seq)
                seq += 1
    except BaseException as exc:  # noqa: BLE001  (asserted on by the test)
        errors.append(exc)


@BOTH_MODES
def test_partitions_come_and_go_under_writers_and_nothing_to_publish_is_emptied(
    servers: Servers, schema: str, db: Conn
) -> None:
    url = servers.database_url
    aggregate_type = f"churn{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    errors: list[BaseException] = []
    stop = threading.Event()
    writers = [
        threading.Thread(target=_write, args=(url, schema, aggregate_type, w, stop, written, errors))
        for w in range(3)
    ]
    upkeep: list[PartitionUpkeep] = []
    for thread in writers:
        thread.start()
    try:
        # As a relay and pruning would, but back to back: partitions created ahead, and every one that
        # can be is emptied and dropped at once (a retention of 0), while no relay reads anything.
        with connect(url, schema) as conn:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline and not errors:
                upkeep.append(maintain_partitions(conn, WIDTH, timedelta(0)))
    finally:
        stop.set()
        for thread in writers:
            thread.join(timeout=30)
    assert errors == [], f"a writer was refused: {errors[0]!r}"
    assert sum(u.created for u in upkeep) >= 5, "partitions were created all along"
    assert sum(u.dropped for u in upkeep) >= 1, "finished (empty) partitions were dropped"
    stored = {str(r[0]) for r in db.execute("SELECT event_id::text FROM outbox")}
    assert stored == set(written), "every row still to publish stays"
    spread = db.execute("SELECT count(DISTINCT tableoid) FROM outbox").fetchone()
    assert spread is not None
    assert int(str(spread[0])) >= 3, "the rows are spread over several partitions"

    with RelayProcess(url, servers.kafka_bootstrap, schema, "--partition-xids", str(WIDTH)) as relay:
        records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
        assert relay.terminate() == 0
    check_delivery(records, written)
