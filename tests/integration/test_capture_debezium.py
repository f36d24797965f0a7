"""postbox's change capture against the real Debezium 3.6.1 PostgreSQL connector (Kafka Connect
standalone, JSON converter without schemas, every option at its default) on the same table and the same
changes: the key, `before`, `after` and `op` of every event byte for byte, tombstones where Debezium sends
them, the same partition and the same order per key; `source` field by field as the docs say
(docs/capture.md): the same fields in the same order, equal where postbox can know them.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict

import psycopg
import pytest

from postbox.relay.capture.admin import SOURCE_VERSION, CaptureOptions, add_capture
from postbox.relay.core.db import connect
from postbox.relay.devstack.postgres import LocalPostgres
from tests.debezium import JSON_CONVERTERS, DebeziumConnect, change_event_options
from tests.support.capture_cases import EVENTS, SCHEMA_SQL, TABLE, run_changes
from tests.support.kafka import Record, read_topic
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

SCHEMA = "postbox"  # the logical_postgres fixture's


def raw_field(value: bytes, name: str, following: str) -> bytes:
    """The exact bytes of one top-level field of an event's value (re-serialising would hide differences)."""
    start = value.index(b'"%s":' % name.encode()) + len(name) + 3
    return value[start : value.index(b',"%s":' % following.encode(), start)]


def per_key(records: list[Record]) -> dict[bytes | None, list[Record]]:
    events: dict[bytes | None, list[Record]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        events[record.key].append(record)
    return events


# Debezium's defaults, then every other value of the options postbox offers (by Debezium's names).
OPTIONS = [
    {},
    {"decimal.handling.mode": "string", "time.precision.mode": "connect", "tombstones.on.delete": "false"},
    {"decimal.handling.mode": "double", "time.precision.mode": "adaptive_time_microseconds"},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=["defaults", "string-connect-no-tombstones", "double-micros"]
)
def test_captured_changes_match_debezium_byte_for_byte(
    servers: Servers, logical_postgres: LocalPostgres, options: dict[str, str]
) -> None:
    app = f"app_{uuid.uuid4().hex[:6]}"
    ours_prefix, theirs_prefix = f"pbx{uuid.uuid4().hex[:6]}", f"dbz{uuid.uuid4().hex[:6]}"
    with psycopg.connect(logical_postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {app}")
        conn.execute(SCHEMA_SQL.format(app=app))
    with connect(logical_postgres.dsn, SCHEMA) as conn, conn.transaction():
        chosen = CaptureOptions(
            topic_prefix=ours_prefix,
            tombstones_on_delete=options.get("tombstones.on.delete", "true") == "true",
            decimal_handling_mode=options.get("decimal.handling.mode", "precise"),
            time_precision_mode=options.get("time.precision.mode", "adaptive"),
        )
        topic = add_capture(conn, SCHEMA, f"{app}.{TABLE}", chosen)
    assert topic == f"{ours_prefix}.{app}.{TABLE}"

    debezium = DebeziumConnect(
        logical_postgres.dsn,
        logical_postgres.port,
        servers.kafka_bootstrap,
        {**change_event_options([f"{app}.{TABLE}"], theirs_prefix), **options},
        converters=JSON_CONVERTERS,
        heap="512M",
    )
    try:
        wait_until(lambda: debezium.streaming(logical_postgres.dsn), 180, interval=0.5, what="Debezium up")
        with psycopg.connect(logical_postgres.dsn, autocommit=True) as writer:
            run_changes(writer, app)
        expected = EVENTS - (2 if options.get("tombstones.on.delete") == "false" else 0)
        theirs = read_topic(servers.kafka_bootstrap, f"{theirs_prefix}.{app}.{TABLE}", expected, timeout=120)
    finally:
        debezium.close(logical_postgres.dsn)
    with RelayProcess(logical_postgres.dsn, servers.kafka_bootstrap, SCHEMA):
        ours = read_topic(servers.kafka_bootstrap, topic, expected, timeout=120)

    assert len(theirs) == len(ours) == expected
    theirs_by_key, ours_by_key = per_key(theirs), per_key(ours)
    assert theirs_by_key.keys() == ours_by_key.keys()
    compared = 0
    for key, their_events in theirs_by_key.items():
        our_events = ours_by_key[key]
        assert len(our_events) == len(their_events), key
        for mine, other in zip(our_events, their_events, strict=True):
            assert mine.partition == other.partition, "the same key must land on the same partition"
            if other.value is None:
                assert mine.value is None, f"{key!r}: Debezium sent a tombstone here"
                continue
            assert mine.value is not None
            for name, following in (("before", "after"), ("after", "source")):
                assert raw_field(mine.value, name, following) == raw_field(other.value, name, following), (
                    key,
                    name,
                )
            mine_json, other_json = json.loads(mine.value), json.loads(other.value)
            assert list(mine_json) == list(other_json), "the envelope's fields, in Debezium's order"
            assert mine_json["op"] == other_json["op"]
            assert mine_json["transaction"] is other_json["transaction"] is None
            check_source(mine_json["source"], other_json["source"], ours_prefix, theirs_prefix)
            if other_json["op"] in ("d", "c") and "__debezium.newkey" in other.headers:
                assert mine.headers["__debezium.newkey"] == other.headers["__debezium.newkey"]
            if "__debezium.oldkey" in other.headers:
                assert mine.headers["__debezium.oldkey"] == other.headers["__debezium.oldkey"]
            compared += 1
    assert compared == EVENTS - 2  # every event but the two tombstones, compared field by field


def check_source(mine: dict[str, object], other: dict[str, object], ours: str, theirs: str) -> None:
    """docs/capture.md's table: what postbox's `source` holds beside Debezium's."""
    assert list(mine) == list(other), "the same fields, in the same order"
    assert (mine["name"], other["name"]) == (ours, theirs)  # the topic prefix, as Debezium's
    assert mine["version"] == SOURCE_VERSION
    for same in ("connector", "snapshot", "db", "schema", "table", "txId", "xmin", "origin", "origin_lsn"):
        assert mine[same] == other[same], same
    # Not known inside the writing transaction: the WAL position of the change.
    assert mine["sequence"] is None
    assert mine["lsn"] is None
    assert other["lsn"] is not None
    # The statement's time, before the commit Debezium stamps: earlier, never by much here.
    assert isinstance(mine["ts_ms"], int)
    assert isinstance(other["ts_ms"], int)
    assert 0 <= other["ts_ms"] - mine["ts_ms"] < 10_000
    assert mine["ts_us"] // 1000 == mine["ts_ms"]
    assert mine["ts_ns"] == mine["ts_us"] * 1000
