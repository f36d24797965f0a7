"""postbox benchmarks, on servers of their own, against the limits of this machine (not a test: it
prints figures and the setup that produced them).

    python -m tests.bench.run                       # everything below, 3 runs each, medians with the spread
    python -m tests.bench.run --rows 100000 --runs 1   # a quick look

Measured, in one run on the same servers:
- limits: single-row-commit insert rate of a writer; the relay's own claim+mark SQL with no Kafka; a raw
  confluent-kafka producer (acks=all, idempotence) with the same messages;
- postbox drain: a backlog of --rows outbox rows drained to Kafka by 1 and by 3 relay processes, from the
  moment the backlog commits until the last row is marked;
- steady state: writers committing one event per transaction at fixed rates with a relay running,
  latency from the writer's commit returning to a consumer receiving the message (so it includes the
  consumer's fetch; the broker's ack comes earlier), NOTIFY on and off;
- the relay's peak resident memory and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import confluent_kafka
import psycopg
from confluent_kafka import Consumer, Producer

from relay.core.migrate import migrate
from relay.core.sql import query
from relay.devstack.kafka import LocalKafka, kafka_version
from relay.devstack.ports import free_port
from relay.devstack.postgres import LocalPostgres, find_bin_dir
from relay.outbox import enqueue
from relay.outbox.daemon import QUERIES
from tests.support import ChildProcess, create_topic, wait_until

SCHEMA = "postbox"
WRITERS = 4  # one connection commits at most ~2k single-row transactions/s here (fsync-bound)


def payload_of(size: int) -> str:
    # A JSON object of about `size` bytes once stored.
    return json.dumps({"order": "o-1", "status": "placed", "pad": "x" * max(0, size - 40)})


def median_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:,.0f}"
    return (
        f"{statistics.median(values):,.0f} (min {min(values):,.0f}, max {max(values):,.0f}, n={len(values)})"
    )


@dataclass
class Servers:
    postgres: LocalPostgres
    kafka: LocalKafka

    def fresh_schema(self) -> None:
        with psycopg.connect(self.postgres.dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            migrate(conn, SCHEMA)


def bench_insert_rate(s: Servers, seconds: float, payload: str) -> float:
    s.fresh_schema()
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


def preload(s: Servers, rows: int, payload: str, aggregate_type: str = "order") -> float:
    """Commit `rows` outbox rows in one transaction; returns the wall time at which they became visible."""
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute(
            "INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT %s, 'o-' || (i %% 1000), 'Placed', %s::jsonb FROM generate_series(1, %s) AS i",
            (aggregate_type, payload, rows),
        )
        conn.commit()
        return time.perf_counter()


def bench_claim_mark(s: Servers, rows: int, payload: str, batch: int) -> float:
    """The relay's own claim + mark statements with no Kafka: the database's ceiling for the relay."""
    s.fresh_schema()
    preload(s, rows, payload)
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute("SET search_path TO postbox")
        conn.execute("UPDATE outbox_shard_lease SET owner = 'bench', expires_at = now() + interval '1 day'")
        conn.commit()
        claim, mark = query(QUERIES, "claim_batch"), query(QUERIES, "mark_batch")
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


def bench_raw_producer(s: Servers, messages: int, payload: str) -> float:
    topic = f"bench-raw-{uuid.uuid4().hex[:6]}"
    create_topic(s.kafka.bootstrap, topic, 6)
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
    value = payload.encode()
    headers = [("id", str(uuid.uuid4()).encode())]
    errors = 0

    def report(error: object, _message: object) -> None:
        nonlocal errors
        errors += error is not None

    started = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                producer.produce(topic, value, f"o-{i % 1000}".encode(), headers=headers, on_delivery=report)
                break
            except BufferError:
                producer.poll(0.01)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(120)
    assert errors == 0
    return messages / (time.perf_counter() - started)


class BenchRelay(ChildProcess):
    """`postbox relay run` with production defaults."""

    def __init__(self, s: Servers, extra: tuple[str, ...] = ()) -> None:
        self.metrics_port = free_port()
        super().__init__(
            f"bench-relay-{uuid.uuid4().hex[:6]}",
            [
                "relay",
                "run",
                "--database-url",
                s.postgres.dsn,
                "--kafka-bootstrap",
                s.kafka.bootstrap,
                "--schema",
                SCHEMA,
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                *extra,
            ],
        )
        self.process_id = self.process.pid

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def usage(self) -> tuple[float, float]:
        """(peak resident MB, CPU seconds) from /proc."""
        status = Path(f"/proc/{self.process_id}/status").read_text()
        peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
        fields = Path(f"/proc/{self.process_id}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return peak_kb / 1024, cpu


def pending(s: Servers) -> int:
    with psycopg.connect(s.postgres.dsn) as conn:
        row = conn.execute("SELECT count(*) FROM postbox.outbox WHERE state = 'pending'").fetchone()
    return int(row[0]) if row else 0


def bench_drain(
    s: Servers, rows: int, payload: str, replicas: int, relay_args: tuple[str, ...] = ()
) -> tuple[float, float, float]:
    """(events/s, peak RSS MB of the largest relay, relay CPU seconds in total)."""
    s.fresh_schema()
    relays = [BenchRelay(s, relay_args) for _ in range(replicas)]
    try:
        wait_until(lambda: all(r.ready() for r in relays), 60, interval=0.2, what="relays ready")
        time.sleep(6)  # let the replicas settle their shard split (leases rebalance every lease-ttl / 3)
        visible = preload(s, rows, payload)
        while pending(s) > 0:
            time.sleep(0.2)
        seconds = time.perf_counter() - visible
        usage = [r.usage() for r in relays]
        for relay in relays:
            assert relay.terminate() == 0
        return rows / seconds, max(u[0] for u in usage), sum(u[1] for u in usage)
    finally:
        for relay in relays:
            relay.__exit__()


def bench_latency(s: Servers, rate: float, seconds: float, listen: bool, payload: str) -> list[float]:
    """Milliseconds from each writer commit to a consumer receiving the message."""
    s.fresh_schema()
    aggregate_type = f"latency{uuid.uuid4().hex[:6]}"
    topic = f"outbox.event.{aggregate_type}"
    create_topic(s.kafka.bootstrap, topic, 6)
    relay = BenchRelay(s, () if listen else ("--no-listen",))
    committed: dict[str, float] = {}
    received: dict[str, float] = {}
    stop = threading.Event()
    consumer = Consumer(
        {
            "bootstrap.servers": s.kafka.bootstrap,
            "group.id": f"lat-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "latest",
            "fetch.wait.max.ms": 5,
            "fetch.min.bytes": 1,
        }
    )

    def consume() -> None:
        consumer.subscribe([topic])
        while not stop.is_set():
            message = consumer.poll(0.05)
            if message is not None and not message.error():
                received[dict(message.headers() or [])["id"].decode()] = time.perf_counter()

    def write(writer: int, writers: int) -> None:
        # Each of `writers` connections commits one event per transaction at rate / writers.
        with psycopg.connect(s.postgres.dsn) as conn:
            interval, next_at = writers / rate, time.perf_counter()
            deadline = next_at + seconds
            i = writer
            while time.perf_counter() < deadline:
                event_id = enqueue(conn, aggregate_type, f"o-{i % 1000}", "Placed", {"pad": payload[:200]})
                conn.commit()
                committed[str(event_id)] = time.perf_counter()
                i += writers
                next_at += interval
                time.sleep(max(0.0, next_at - time.perf_counter()))

    try:
        wait_until(relay.ready, 60, interval=0.2, what="relay ready")
        reader = threading.Thread(target=consume)
        reader.start()
        time.sleep(3)  # the consumer joins its group before the clock starts
        writers = [threading.Thread(target=write, args=(w, WRITERS)) for w in range(WRITERS)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        wait_until(lambda: len(received) >= len(committed), 60, interval=0.2, what="every event received")
        stop.set()
        reader.join()
        assert relay.terminate() == 0
    finally:
        stop.set()
        consumer.close()
        relay.__exit__()
    return sorted((received[e] - committed[e]) * 1000 for e in committed)


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))]


def repeat(runs: int, measure: Callable[[], float]) -> list[float]:
    return [measure() for _ in range(runs)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument("--relay-batch-size", type=int, default=500, help="the relays' --batch-size")
    parser.add_argument(
        "--only",
        choices=["limits", "drain", "latency"],
        action="append",
        help="run only these parts (repeatable)",
    )
    args = parser.parse_args()
    postgres = LocalPostgres(find_bin_dir()).start()
    kafka = LocalKafka(default_partitions=6).start()
    s = Servers(postgres, kafka)
    out: list[str] = []

    def say(line: str) -> None:
        out.append(line)
        print(line, flush=True)

    try:
        say(
            f"setup: {os.cpu_count()} cores, Python {platform.python_version()}, PostgreSQL "
            f"{postgres.server_version()} (fsync on, defaults), Kafka {kafka_version()} (1 KRaft node, "
            f"6 partitions), librdkafka {confluent_kafka.libversion()[0]}; relay defaults: batch 500, "
            f"acks=all, idempotence, lz4, linger.ms 5; backlog {args.rows:,} rows; {args.runs} runs each"
        )
        parts = set(args.only or ["limits", "drain", "latency"])
        relay_args = ("--batch-size", str(args.relay_batch_size))
        for size in (200, 1024):
            payload = payload_of(size)
            if parts & {"limits", "drain"}:
                say(f"\n-- payload {size} bytes --")
            if "limits" in parts:
                inserts = repeat(args.runs, lambda p=payload: bench_insert_rate(s, 5, p))
                say(f"limit: single-row-commit inserts/s      {median_spread(inserts)}")
                claims = repeat(
                    args.runs, lambda p=payload: bench_claim_mark(s, min(args.rows, 300_000), p, 500)
                )
                say(f"limit: claim+mark SQL rows/s (no Kafka) {median_spread(claims)}")
                produced = repeat(
                    args.runs, lambda p=payload: bench_raw_producer(s, min(args.rows, 500_000), p)
                )
                say(f"limit: raw producer msgs/s              {median_spread(produced)}")
            if "drain" in parts:
                for replicas in (1, 3):
                    results = [
                        bench_drain(s, args.rows, payload, replicas, relay_args) for _ in range(args.runs)
                    ]
                    say(
                        f"postbox drain, {replicas} relay(s), batch {args.relay_batch_size}, events/s "
                        f"{median_spread([r[0] for r in results])}; peak RSS per relay "
                        f"{max(r[1] for r in results):.0f} MB; "
                        f"relay CPU {statistics.median(r[2] for r in results):.1f} s"
                    )
        if "latency" not in parts:
            return 0
        say(f"\n-- steady state, 200-byte payloads, one event per transaction, {WRITERS} writers --")
        for rate in (1000, 5000):
            for listen in (True, False):
                latencies = bench_latency(s, rate, args.latency_seconds, listen, payload_of(200))
                say(
                    f"{rate}/s, NOTIFY {'on ' if listen else 'off'}: commit->consumer ms "
                    f"p50 {percentile(latencies, 0.5):.1f}  p99 {percentile(latencies, 0.99):.1f}  "
                    f"p999 {percentile(latencies, 0.999):.1f}  (n={len(latencies)}, "
                    f"achieved {len(latencies) / args.latency_seconds:,.0f}/s)"
                )
    finally:
        kafka.stop()
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
