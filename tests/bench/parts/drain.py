"""The "drain" part (`python -m tests.bench.run --only drain`), for each --payload-sizes: a backlog of --rows
outbox rows, committed in one transaction, drained to Kafka by 1 and by 3 postbox relays in queue mode (from
the commit until the last row is marked published) and in log mode (until every shard's cursor has passed
the backlog), and by Debezium's PostgreSQL connector with its outbox event router in Kafka Connect
standalone (from the commit until the last message is on the broker: Debezium has no mark step, so this
favours it slightly); resident memory (peak) and CPU seconds of each publishing process, and the whole
machine's CPU seconds. On the servers tests.bench.run starts (tests.bench.harness.servers: PostgreSQL with
wal_level=logical, which Debezium needs, so both tools see the same database)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

from tests.bench.harness.servers import (
    PARTITIONS,
    BenchServers,
    machine_busy_seconds,
    process_usage,
    publishing,
)
from tests.bench.harness.stats import median_spread
from tests.bench.harness.traffic import preload


def on_broker(bootstrap: str, topic: str) -> int:
    """Messages in `topic` (its partitions' high watermarks: a fresh topic, so no gaps)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-watermarks"})
    try:
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS)
        )
    finally:
        consumer.close()


def pending(s: BenchServers) -> int:
    """Rows still to publish: pending ones, or in log mode, while any shard's cursor has not passed the
    newest logged row's transaction, 1 (a cheap test over 64 cursors, where counting would read the
    table on every look)."""
    with psycopg.connect(s.postgres.dsn) as conn:
        row = conn.execute(
            """SELECT (SELECT count(*) FROM postbox.outbox WHERE state = 'pending')
                      + (SELECT count(*) FROM postbox.outbox_cursor AS c
                         JOIN postbox.outbox_tick AS t ON t.tick = c.tick
                         WHERE NOT pg_visible_in_snapshot(
                             (SELECT max(txid) FROM postbox.outbox WHERE state = 'logged'), t.snapshot))"""
        ).fetchone()
    return int(row[0]) if row else 0


def bench_drain(
    s: BenchServers,
    rows: int,
    payload: str,
    tool: str,
    replicas: int = 1,
    relay_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    sampled_every: int | None = None,
    mode: str = "queue",
    code: Path | None = None,
) -> tuple[float, float, float, float]:
    """(events/s, peak RSS MB of the largest publisher, the publishers' CPU seconds, the whole machine's
    CPU seconds), all over the drain. mode: the outbox's and the relays' (postbox only). code: a checkout
    whose relay to run (see BenchRelay)."""
    s.fresh_schema(mode)
    if tool == "postbox":
        relay_args = (*relay_args, "--mode", mode)
    aggregate_type, topic = s.fresh_topic("drain")
    with publishing(s, tool, replicas, relay_args, env=env, code=code) as publishers:
        cpu_before = sum(process_usage(p.process_id)[1] for p in publishers)
        visible = preload(s, rows, payload, aggregate_type, sampled_every)
        machine_before = machine_busy_seconds()
        if tool == "postbox":
            while pending(s) > 0:
                time.sleep(0.2)
        else:
            while on_broker(s.kafka.bootstrap, topic) < rows:
                time.sleep(0.2)
        seconds = time.perf_counter() - visible
        machine = machine_busy_seconds() - machine_before
        usage = [process_usage(p.process_id) for p in publishers]
        for publisher in publishers:
            publisher.terminate()
    assert on_broker(s.kafka.bootstrap, topic) >= rows
    return rows / seconds, max(u[0] for u in usage), sum(u[1] for u in usage) - cpu_before, machine


def run_part(
    s: BenchServers,
    args: argparse.Namespace,
    payload: str,
    tools: list[str],
    relay_args: tuple[str, ...],
    say: Callable[[str], None],
) -> None:
    """One payload size's drains, by each tool in `tools` (run.py prints the size's heading)."""
    drains = [
        ("postbox, 1 relay            ", "postbox", 1, relay_args, "queue"),
        ("postbox, 3 relays           ", "postbox", 3, relay_args, "queue"),
        ("postbox, 1 relay, delete    ", "postbox", 1, (*relay_args, "--delete-on-publish"), "queue"),
        ("postbox log, 1 relay        ", "postbox", 1, relay_args, "log"),
        ("postbox log, 3 relays       ", "postbox", 3, relay_args, "log"),
    ] + [("Debezium, 1 task            ", "debezium", 1, (), "queue")] * (len(tools) - 1)
    for who, tool, replicas, extra, mode in drains:
        results = [
            bench_drain(s, args.rows, payload, tool, replicas, extra, mode=mode) for _ in range(args.runs)
        ]
        say(
            f"drain {who}: events/s {median_spread([r[0] for r in results])}; "
            f"peak RSS per process {max(r[1] for r in results):.0f} MB; "
            f"CPU while draining: publishers {statistics.median(r[2] for r in results):.1f} s, "
            f"whole machine {statistics.median(r[3] for r in results):.1f} s"
        )
