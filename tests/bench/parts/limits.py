"""The "limits" part (`python -m tests.bench.run --only limits`), for each --payload-sizes: single-row-commit
insert rate of a writer (into a queue-mode and a log-mode outbox); the relay's own claim+mark SQL with no
Kafka, and log mode's read (the relay's own log source: windows, pages and cursor moves) with no Kafka; a
raw confluent-kafka producer (acks=all, idempotence) with the same messages. On the servers tests.bench.run
starts (tests.bench.harness.servers)."""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable

import psycopg
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from postbox.relay.core.db import connect
from postbox.relay.core.sql import query
from postbox.relay.outbox.daemon import QUERIES
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import DELIVERED, decide
from postbox.relay.outbox.settings import (
    DEFAULT_MESSAGE_MAX_BYTES,
    LOG_BATCH_ROWS,
    QUEUE_BATCH_ROWS,
    RelaySettings,
)
from postbox.relay.outbox.sources.base import ReadLimits
from postbox.relay.outbox.sources.log import LogSource
from postbox.relay.outbox.sources.queue import Claimer
from tests.bench.harness.servers import PARTITIONS, SCHEMA, BenchServers
from tests.bench.harness.stats import median_spread, repeat
from tests.bench.harness.traffic import preload
from tests.support.kafka import create_topic

# The claim's byte budget as the relay runs it by default.
CLAIM_BYTES = {
    "max_message_bytes": DEFAULT_MESSAGE_MAX_BYTES,
    "max_batch_bytes": RelaySettings.max_batch_bytes,
}


def bench_insert_rate(s: BenchServers, seconds: float, payload: str, mode: str = "queue") -> float:
    s.fresh_schema(mode)
    count = 0
    with psycopg.connect(s.postgres.dsn) as conn:
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        while time.perf_counter() < deadline:
            conn.execute(
                "INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type, payload) "
                "VALUES ('order', %s, 'Placed', %s)",
                (f"o-{count % 1000}", payload),
            )
            conn.commit()
            count += 1
        return count / (time.perf_counter() - started)


def bench_claim_mark(s: BenchServers, rows: int, payload: str, batch: int, delete_on_publish: bool) -> float:
    """The relay's own claim + mark statements with no Kafka: the database's ceiling for the relay."""
    s.fresh_schema()
    preload(s, rows, payload)
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute("SET search_path TO postbox")
        conn.execute(query(QUERIES, "lane_session"))
        conn.execute("UPDATE outbox_shard_lease SET owner = 'bench', expires_at = now() + interval '1 day'")
        conn.commit()
        claim = query(QUERIES, "claim_batch")
        mark = query(QUERIES, "mark_batch_deleting" if delete_on_publish else "mark_batch")
        done = 0
        started = time.perf_counter()
        while True:
            with conn.transaction():
                ids = [
                    r[0]
                    for r in conn.execute(
                        claim,
                        {
                            "shards": list(range(64)),
                            "lock_space": 1,
                            "limit": batch,
                            "blocked_topics": [],
                            "blocked_types": [],
                            **CLAIM_BYTES,
                        },
                    )
                ]
                if not ids:
                    break
                conn.execute(
                    mark,
                    {
                        "relay_id": "bench",
                        "ids": ids,
                        "states": ["published"] * len(ids),
                        "errors": [None] * len(ids),
                    },
                )
            done += len(ids)
        return done / (time.perf_counter() - started)


def bench_log_read(s: BenchServers, rows: int, payload: str, batch: int) -> float:
    """Log mode's read with no Kafka: the relay's own log source over every shard (one lane), each page's
    rows taken as published and the cursors moved, one transaction per page: the database's ceiling for
    log mode, beside claim+mark's for queue mode."""
    s.fresh_schema("log")
    preload(s, rows, payload)
    limits = ReadLimits(batch, CLAIM_BYTES["max_message_bytes"], CLAIM_BYTES["max_batch_bytes"], [], [])
    with connect(s.postgres.dsn, SCHEMA) as conn, connect(s.postgres.dsn, SCHEMA, autocommit=True) as ticks:
        source = LogSource(
            Claimer("bench", 1, delete_on_publish=False),
            batch,
            schema=SCHEMA,
            tick_interval=0.0,
            tick_conn=lambda: ticks,
            tick_lock=threading.Lock(),
            metrics=RelayMetrics(CollectorRegistry()),
        )
        conn.execute(query(QUERIES, "lane_session"))
        conn.execute("UPDATE outbox_shard_lease SET owner = 'bench', expires_at = now() + interval '1 day'")
        conn.commit()
        done = 0
        started = time.perf_counter()
        while done < rows:
            page = source.read(conn, list(range(64)), limits)
            if page is None:
                conn.commit()
                continue
            ids = [r.id for r in page.records]
            page.mark(conn, decide(ids, [""] * len(ids), [DELIVERED] * len(ids)))
            conn.commit()
            done += len(ids)
        return done / (time.perf_counter() - started)


def bench_raw_producer(s: BenchServers, messages: int, payload: str) -> tuple[float, str]:
    """(messages/s, the topic they are in): each message has a distinct `id` header, as relayed ones do."""
    topic = f"bench-raw-{uuid.uuid4().hex[:6]}"
    create_topic(s.kafka.bootstrap, topic, PARTITIONS)
    producer = Producer(
        {
            "bootstrap.servers": s.kafka.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    # The idempotent producer first acquires its producer id (the broker may answer "coordinator load in
    # progress" for a while after it starts): done before the clock starts, as a relay does it at start-up.
    producer.produce(f"{topic}-warmup", b"")
    producer.flush(60)
    value = payload.encode()
    errors = 0

    def report(error: object, _message: object) -> None:
        nonlocal errors
        errors += error is not None

    started = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                producer.produce(
                    topic, value, f"o-{i % 1000}".encode(), headers=[("id", b"%d" % i)], on_delivery=report
                )
                break
            except BufferError:
                producer.poll(0.01)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(120)
    assert errors == 0
    return messages / (time.perf_counter() - started), topic


def run_part(s: BenchServers, args: argparse.Namespace, payload: str, say: Callable[[str], None]) -> None:
    """One payload size's limits (run.py prints the size's heading)."""
    for mode in ("queue", "log"):
        inserts = repeat(args.runs, lambda p=payload, m=mode: bench_insert_rate(s, 5, p, m))
        say(f"limit: single-row-commit inserts/s, {mode:5} mode {median_spread(inserts)}")
    for delete in (False, True):
        claims = repeat(
            args.runs,
            lambda p=payload, d=delete: bench_claim_mark(
                s, min(args.rows, 300_000), p, args.relay_batch_size or QUEUE_BATCH_ROWS, d
            ),
        )
        how = "delete" if delete else "update"
        say(f"limit: claim+mark({how}) SQL rows/s, no Kafka {median_spread(claims)}")
    reads = repeat(
        args.runs,
        lambda p=payload: bench_log_read(
            s, min(args.rows, 300_000), p, args.relay_batch_size or LOG_BATCH_ROWS
        ),
    )
    say(f"limit: log mode read SQL rows/s, no Kafka  {median_spread(reads)}")
    produced = repeat(args.runs, lambda p=payload: bench_raw_producer(s, min(args.rows, 500_000), p)[0])
    say(f"limit: raw producer msgs/s              {median_spread(produced)}")
