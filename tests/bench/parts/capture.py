"""The "capture" part (`python -m tests.bench.run --only capture`): what capturing a table costs its writers,
and how fast its changes reach Kafka, each against a peer measured in the same run on the same servers.

- writers, single-row commits: --capture-commits INSERTs, each its own transaction, into a captured table
  and into an uncaptured table of the same shape, the two alternated round by round (so the machine's
  noise falls on both); the ratio of their rates per round. Target: captured within 10% of uncaptured.
- writers, bulk: one INSERT ... SELECT of --capture-rows rows into each table, alternated. Target: the
  captured rate at least half the uncaptured.
- drain: the changes of one such bulk INSERT to Kafka, by a postbox relay (log mode, the default: from
  the commit until every shard's cursor has passed it) and by Debezium's PostgreSQL connector with plain
  change events (JSON converter without schemas, as postbox writes them: from the commit until the last
  message is on the broker). Target: postbox at least Debezium's rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import psycopg

from postbox.relay.capture.admin import CaptureOptions, add_capture
from postbox.relay.core.db import connect
from tests.bench.harness.servers import SCHEMA, BenchServers, publishing
from tests.bench.harness.stats import median_spread
from tests.bench.parts.drain import on_broker, pending
from tests.debezium import JSON_CONVERTERS, DebeziumConnect, change_event_options
from tests.support.kafka import create_topic
from tests.support.waiting import wait_until

APP = "shop"
TABLE_SQL = (
    "CREATE TABLE {table} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer text NOT NULL, "
    "total numeric(10,2) NOT NULL, status text NOT NULL, note text, "
    "created_at timestamptz NOT NULL DEFAULT now())"
)
NOTE = "a note of some forty characters, typical"


def fresh_tables(s: BenchServers, *names: str) -> None:
    s.fresh_schema("log")
    with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {APP} CASCADE")
        conn.execute(f"CREATE SCHEMA {APP}")
        for name in names:
            conn.execute(TABLE_SQL.format(table=f"{APP}.{name}"))


def capture(s: BenchServers, table: str) -> str:
    with connect(s.postgres.dsn, SCHEMA) as conn, conn.transaction():
        return add_capture(
            conn, SCHEMA, f"{APP}.{table}", CaptureOptions(topic_prefix=f"bench{uuid.uuid4().hex[:6]}")
        )


def single_row_rate(s: BenchServers, table: str, commits: int) -> float:
    statement = f"INSERT INTO {APP}.{table} (customer, total, status, note) VALUES (%s, %s, 'placed', %s)"
    with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:
        started = time.perf_counter()
        for i in range(commits):
            conn.execute(statement, (f"customer-{i}", i % 10000 / 100, NOTE))
        return commits / (time.perf_counter() - started)


def bulk_rate(s: BenchServers, table: str, rows: int) -> float:
    with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(
            f"INSERT INTO {APP}.{table} (customer, total, status, note) "
            f"SELECT 'customer-' || i, (i % 10000) / 100.0, 'placed', '{NOTE}' "
            f"FROM generate_series(1, {rows}) AS i"
        )
        return rows / (time.perf_counter() - started)


def paired(runs: int, measure: Callable[[str], float]) -> tuple[list[float], list[float]]:
    """(captured rates, uncaptured rates), the order alternated round by round."""
    captured, plain = [], []
    for round_ in range(runs):
        for table in ("captured", "plain") if round_ % 2 == 0 else ("plain", "captured"):
            (captured if table == "captured" else plain).append(measure(table))
    return captured, plain


def drain_postbox(s: BenchServers, rows: int) -> float:
    fresh_tables(s, "orders")
    topic = capture(s, "orders")
    create_topic(s.kafka.bootstrap, topic, 6)
    with publishing(s, "postbox") as publishers:
        started = time.perf_counter()
        bulk_rate(s, "orders", rows)
        while pending(s) > 0:
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        for publisher in publishers:
            publisher.terminate()
    assert on_broker(s.kafka.bootstrap, topic) >= rows
    return rows / seconds


def drain_debezium(s: BenchServers, rows: int) -> float:
    fresh_tables(s, "orders")
    prefix = f"dbz{uuid.uuid4().hex[:6]}"
    topic = f"{prefix}.{APP}.orders"
    create_topic(s.kafka.bootstrap, topic, 6)
    debezium = DebeziumConnect(
        s.postgres.dsn,
        s.postgres.port,
        s.kafka.bootstrap,
        change_event_options([f"{APP}.orders"], prefix),
        converters=JSON_CONVERTERS,
    )
    try:
        wait_until(lambda: debezium.streaming(s.postgres.dsn), 180, interval=0.5, what="Debezium streaming")
        started = time.perf_counter()
        bulk_rate(s, "orders", rows)
        while on_broker(s.kafka.bootstrap, topic) < rows:
            time.sleep(0.2)
        return rows / (time.perf_counter() - started)
    finally:
        debezium.close(s.postgres.dsn)


def run_part(s: BenchServers, args: argparse.Namespace, tools: list[str], say: Callable[[str], None]) -> None:
    rows, commits = args.capture_rows, args.capture_commits
    say(f"\n-- capture: {commits} single-row commits, bulk and drain of {rows:,} rows --")
    fresh_tables(s, "captured", "plain")
    capture(s, "captured")
    writers = [
        ("single-row commits/s", lambda table: single_row_rate(s, table, commits), 0.9),
        ("bulk INSERT rows/s", lambda table: bulk_rate(s, table, rows), 0.5),
    ]
    for what, measure, target in writers:
        captured, plain = paired(args.runs, measure)
        ratios = [c / p for c, p in zip(captured, plain, strict=True)]
        met = "met" if statistics.median(ratios) >= target else "NOT met"
        say(
            f"{what}: captured {median_spread(captured)}, uncaptured {median_spread(plain)}; "
            f"captured/uncaptured {median_spread(ratios, 2)} (target >= {target:.2f}: {met})"
        )
    ours = [drain_postbox(s, rows) for _ in range(args.runs)]
    say(f"capture drain events/s: postbox, 1 relay (log mode) {median_spread(ours)}")
    if "debezium" in tools:
        theirs = [drain_debezium(s, rows) for _ in range(args.runs)]
        ratio = statistics.median(ours) / statistics.median(theirs)
        say(
            f"capture drain events/s: Debezium, 1 task {median_spread(theirs)}; postbox/Debezium {ratio:.2f} "
            f"(target >= 1.00: {'met' if ratio >= 1 else 'NOT met'})"
        )
