"""The "consumers" part (`python -m tests.bench.run --only consumers`): the inbox consumer against its limit
(the inbox's claim statement and commit, no Kafka) and against a raw confluent-kafka consumer on the same
messages, at batch sizes 100, 500 and 1000 with a handler that does nothing, and at 500 with one that does
one INSERT (`python -m tests.bench.profile_inbox` shows where its time goes). On the servers tests.bench.run
starts (tests.bench.harness.servers)."""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import psycopg
from confluent_kafka import Consumer

from postbox.inbox.applying import QUERIES as INBOX_QUERIES
from postbox.relay.core.sql import query
from tests.apps.noop import SCHEMA_SQL as NOOP_SCHEMA_SQL
from tests.bench.harness.servers import PARTITIONS, SCHEMA, BenchServers, process_usage
from tests.bench.harness.stats import median_spread, repeat
from tests.bench.harness.traffic import payload_of
from tests.bench.parts.limits import bench_raw_producer
from tests.support.processes import InboxProcess
from tests.support.waiting import wait_until

INBOX_BATCHES = (100, 500, 1000)


def bench_raw_consumer(s: BenchServers, topic: str, messages: int) -> float:
    """A plain confluent-kafka consumer reading `messages` from the start: first message to last."""
    consumer = Consumer(
        {
            "bootstrap.servers": s.kafka.bootstrap,
            "group.id": f"raw-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": True,
        }
    )
    consumer.subscribe([topic])
    seen, first = 0, 0.0
    try:
        while seen < messages:
            for message in consumer.consume(500, timeout=1.0):
                if message.error() is None:
                    first = first or time.perf_counter()
                    seen += 1
        return messages / (time.perf_counter() - first)
    finally:
        consumer.close()


def bench_inbox_claim(s: BenchServers, messages: int, batch: int) -> float:
    """The inbox's own limit: its claim statement (the consumer's `claim_messages`, arrays in binary as the
    consumer sends them) and the commit, for batches of `batch` new message ids on one connection. No
    Kafka, no handler; the parameters are built before the clock starts."""
    s.fresh_schema()
    claim = query(INBOX_QUERIES, "claim_messages")
    batches = []
    for first in range(0, messages, batch):
        offsets = list(range(first, min(first + batch, messages)))
        batches.append(
            {
                "consumer": "bench-limit",
                "ids": [f"bench/{o % PARTITIONS}/{o}" for o in offsets],
                "topics": ["bench"] * len(offsets),
                "partitions": [o % PARTITIONS for o in offsets],
                "offsets": offsets,
                "keys": [b"o-%d" % (o % 1000) for o in offsets],
            }
        )
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.commit()
        started = time.perf_counter()
        for params in batches:
            claimed = conn.execute(claim, params).fetchall()
            conn.commit()
            assert len(claimed) == len(params["ids"])
        return messages / (time.perf_counter() - started)


def bench_inbox(
    s: BenchServers, topic: str, messages: int, batch: int = 500, app: str = "tests.apps.noop:inbox"
) -> tuple[float, float, float]:
    """(messages/s into the inbox, peak RSS MB, CPU s): `postbox inbox consume` with the app's handler,
    measured from its first claim row to its last (the database clock), so start-up is left out."""
    s.fresh_schema()
    with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.execute(NOOP_SCHEMA_SQL)
    # A group of its own: the variants read the same topic, each from the start.
    group = f"bench-inbox-{uuid.uuid4().hex[:6]}"
    with InboxProcess(
        s.postgres.dsn,
        s.kafka.bootstrap,
        SCHEMA,
        app,
        [topic],
        "--batch-size",
        str(batch),
        "--group-id",
        group,
        log_level="info",
    ) as inbox:
        with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:

            def stored() -> int:
                row = conn.execute("SELECT count(*) FROM postbox.inbox_message").fetchone()
                return int(row[0]) if row else 0

            wait_until(lambda: stored() >= messages, 600, interval=0.5, what="every message in the inbox")
            row = conn.execute(
                "SELECT extract(epoch FROM max(received_at) - min(received_at)) FROM postbox.inbox_message"
            ).fetchone()
        assert row is not None
        peak, cpu = process_usage(inbox.process.pid)
        assert inbox.terminate() == 0
    return messages / float(row[0]), peak, cpu


def run_part(s: BenchServers, args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """The inbox's limit, then the raw consumer and the inbox consumer's variants."""
    messages = min(args.rows, 200_000)
    say(f"\n-- consumers: {messages:,} messages of 200 bytes, {PARTITIONS} partitions --")
    for batch in INBOX_BATCHES:
        limits = repeat(args.runs, lambda b=batch: bench_inbox_claim(s, messages, b))
        say(f"limit: inbox claim+commit msgs/s, batch {batch:4}, no Kafka {median_spread(limits)}")
    variants = [(b, "tests.apps.noop:inbox", "no-op handler") for b in INBOX_BATCHES]
    variants.append((500, "tests.apps.noop:writing", "one INSERT per message"))
    raw: list[float] = []
    inbox: dict[tuple[int, str, str], list[tuple[float, float, float]]] = {v: [] for v in variants}
    for _ in range(args.runs):
        _, topic = bench_raw_producer(s, messages, payload_of(200))
        raw.append(bench_raw_consumer(s, topic, messages))
        for batch, app, _label in variants:
            inbox[batch, app, _label].append(bench_inbox(s, topic, messages, batch, app))
    say(f"raw confluent-kafka consumer msgs/s      {median_spread(raw)}")
    for (batch, _app, label), results in inbox.items():
        cpu_per_message = statistics.median(r[2] for r in results) / messages * 1e6
        peak = max(r[1] for r in results)
        say(
            f"postbox inbox consume, batch {batch:4}, {label}: msgs/s "
            f"{median_spread([r[0] for r in results])}; peak RSS {peak:.0f} MB; "
            f"consumer CPU {cpu_per_message:.0f} us per message (start-up included)"
        )
