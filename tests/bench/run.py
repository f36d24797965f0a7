"""postbox benchmarks, on servers of their own, against the limits of this machine and against Debezium
(not a test: it prints figures and the setup that produced them).

    python -m tests.bench.run                       # everything below, 3 runs each, medians with the spread
    python -m tests.bench.run --rows 100000 --runs 1   # a quick look
    python -m tests.bench.run --only drain --only peer # some parts only

Measured, in one run on the same servers (PostgreSQL runs with wal_level=logical throughout, which
Debezium needs, so both tools see the same database):
- limits: single-row-commit insert rate of a writer (into a queue-mode and a log-mode outbox); the relay's
  own claim+mark SQL with no Kafka, and log mode's read (the relay's own LogReader: windows, pages and
  cursor moves) with no Kafka; a raw confluent-kafka producer (acks=all, idempotence) with the same
  messages;
- drain: a backlog of --rows outbox rows, committed in one transaction, drained to Kafka by 1 and by 3
  postbox relays in queue mode (from the commit until the last row is marked published) and in log mode
  (until every shard's cursor has passed the backlog), and by Debezium's PostgreSQL
  connector with its outbox event router in Kafka Connect standalone (from the commit until the last
  message is on the broker: Debezium has no mark step, so this favours it slightly);
- steady state: writers committing one event per transaction at fixed rates, latency from the writer's
  commit returning to a consumer receiving the message (so it includes the consumer's fetch; the broker's
  ack comes earlier): postbox with NOTIFY on and off, postbox in log mode, and Debezium;
- resident memory (peak) and CPU seconds of each publishing process;
- longtx: log mode's and queue mode's steady-state latency (200 events/s for 60 s) with a transaction
  elsewhere that holds an id open for the whole run, against none;
- tracing: one relay's drain and steady-state latency with OpenTelemetry absent, installed but off, and
  on (every span, 1% by the relay's sampler, 1% by the writers' with the default parent-based sampler),
  exporting OTLP/HTTP to a receiver in this process;
- the inbox consumer against its limit (the inbox's claim statement and commit, no Kafka) and against a
  raw confluent-kafka consumer on the same messages, at batch sizes 100, 500 and 1000 with a handler that
  does nothing, and at 500 with one that does one INSERT (`python -m tests.bench.profile_inbox` shows
  where its time goes); the webhook receiver under wrk with Stripe signatures checked (every request
  distinct).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import confluent_kafka
import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition

from postbox.inbox.applying import QUERIES as INBOX_QUERIES
from postbox.inbox.webhooks.providers import stripe_signature_header
from postbox.relay.core.db import connect
from postbox.relay.core.migrate import migrate
from postbox.relay.core.sql import query
from postbox.relay.devstack.kafka import LocalKafka, kafka_version
from postbox.relay.devstack.ports import free_port
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from postbox.relay.outbox import enqueue
from postbox.relay.outbox.admin import switch_mode
from postbox.relay.outbox.daemon import QUERIES
from postbox.relay.outbox.log_reader import LogReader
from postbox.relay.outbox.outcome import DELIVERED, decide
from postbox.relay.outbox.settings import (
    DEFAULT_MESSAGE_MAX_BYTES,
    LOG_BATCH_ROWS,
    QUEUE_BATCH_ROWS,
    RelaySettings,
)
from tests.apps.noop import SCHEMA_SQL as NOOP_SCHEMA_SQL
from tests.debezium import DebeziumConnect, debezium_version
from tests.otlp import OtlpReceiver
from tests.support.kafka import create_topic
from tests.support.probes import http_get
from tests.support.processes import ChildProcess, InboxProcess, ReceiverProcess
from tests.support.repo import REPO
from tests.support.waiting import wait_until
from tests.support.webhooks import STRIPE_SECRET

SCHEMA = "postbox"
INBOX_BATCHES = (100, 500, 1000)
WEBHOOK_CONNECTIONS = (16, 64, 256)
WRITERS = 4  # one connection commits at most ~2k single-row transactions/s here (fsync-bound)
PARTITIONS = 6


def payload_of(size: int) -> str:
    # A JSON object of about `size` bytes once stored.
    return json.dumps({"order": "o-1", "status": "placed", "pad": "x" * max(0, size - 40)})


def median_spread(values: list[float], decimals: int = 0) -> str:
    def show(value: float) -> str:
        return f"{value:,.{decimals}f}"

    if len(values) == 1:
        return show(values[0])
    spread = f"min {show(min(values))}, max {show(max(values))}, n={len(values)}"
    return f"{show(statistics.median(values))} ({spread})"


@dataclass
class BenchServers:
    """The servers a benchmark started for itself and owns: the LocalPostgres and LocalKafka themselves
    (their port for Debezium, their lifetime the benchmark's), one schema `postbox` that fresh_schema drops
    and migrates again for each run, and a topic of PARTITIONS partitions per run from fresh_topic.

    Not the tests' tests.support.servers.Servers, which is only where to find servers (from the environment,
    testcontainers or the local runner), shared by a whole session and possibly someone else's: each test
    migrates a schema of its own and never drops one it did not make."""

    postgres: LocalPostgres
    kafka: LocalKafka

    def fresh_schema(self, mode: str = "queue") -> None:
        with psycopg.connect(self.postgres.dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            migrate(conn, SCHEMA)
        if mode == "log":
            with connect(self.postgres.dsn, SCHEMA) as conn:
                switch_mode(conn, SCHEMA, "log")

    def fresh_topic(self, prefix: str) -> tuple[str, str]:
        """(aggregate type, its topic): a topic of its own per run, so counting its messages is exact."""
        aggregate_type = f"{prefix}{uuid.uuid4().hex[:6]}"
        topic = f"outbox.event.{aggregate_type}"
        create_topic(self.kafka.bootstrap, topic, PARTITIONS)
        return aggregate_type, topic


def process_usage(process_id: int) -> tuple[float, float]:
    """(peak resident MB, CPU seconds since it started) of a live process, from /proc. Callers take the
    CPU figure before and after what they measure, so start-up (a JVM's above all) is left out."""
    status = Path(f"/proc/{process_id}/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    fields = Path(f"/proc/{process_id}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return peak_kb / 1024, cpu


def machine_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine since boot (all cores, idle and iowait left out):
    the difference across a drain is what it cost the whole machine (PostgreSQL, Kafka and the publisher)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def on_broker(bootstrap: str, topic: str) -> int:
    """Messages in `topic` (its partitions' high watermarks: a fresh topic, so no gaps)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-watermarks"})
    try:
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS)
        )
    finally:
        consumer.close()


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


def preload(
    s: BenchServers, rows: int, payload: str, aggregate_type: str = "order", sampled_every: int | None = None
) -> float:
    """Commit `rows` outbox rows in one transaction; returns the wall time at which they became visible.
    With `sampled_every`, each row carries a writer's W3C traceparent (as enqueue stores it), one in
    `sampled_every` of them with the sampled flag."""
    traceparent = (
        "jsonb_build_object('traceparent', '00-' || md5(i::text) || '-' || left(md5('s' || i), 16) || '-' "
        "|| CASE WHEN i %% %s = 0 THEN '01' ELSE '00' END)"
    )
    headers = traceparent if sampled_every else "'{}'::jsonb"
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute(
            "INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
            f"SELECT %s, 'o-' || (i %% 1000), 'Placed', %s::jsonb, {headers} "
            "FROM generate_series(1, %s) AS i",
            (aggregate_type, payload, *((sampled_every,) if sampled_every else ()), rows),
        )
        conn.commit()
        return time.perf_counter()


def writer_context(i: int, sampled_every: int | None) -> dict[str, str]:
    """The headers of event `i` of a traced writer (see preload), or none."""
    if not sampled_every:
        return {}
    flags = "01" if i % sampled_every == 0 else "00"
    return {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{flags}"}


# The claim's byte budget as the relay runs it by default.
CLAIM_BYTES = {
    "max_message_bytes": DEFAULT_MESSAGE_MAX_BYTES,
    "max_batch_bytes": RelaySettings.max_batch_bytes,
}


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
    """Log mode's read with no Kafka: the relay's own LogReader over every shard (one lane), each page's
    rows taken as published and the cursors moved, one transaction per page: the database's ceiling for
    log mode, beside claim+mark's for queue mode."""
    s.fresh_schema("log")
    preload(s, rows, payload)
    reader = LogReader(SCHEMA, "bench", 0.0)
    params = {"limit": batch, **CLAIM_BYTES}
    with connect(s.postgres.dsn, SCHEMA) as conn, connect(s.postgres.dsn, SCHEMA, autocommit=True) as ticks:
        conn.execute(query(QUERIES, "lane_session"))
        conn.execute("UPDATE outbox_shard_lease SET owner = 'bench', expires_at = now() + interval '1 day'")
        conn.commit()
        done = 0
        started = time.perf_counter()
        while done < rows:
            read = reader.read(conn, ticks, reader.lock(conn, list(range(64))), params)
            if read is None:
                conn.commit()
                continue
            page_rows, page = read
            ids, shards = [int(r[0]) for r in page_rows], [int(r[9]) for r in page_rows]
            reader.finish(conn, page, ids, shards, decide(ids, [""] * len(ids), [DELIVERED] * len(ids)))
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


class Publisher(Protocol):
    """A process that moves outbox rows to Kafka: a postbox relay or the Debezium worker."""

    process_id: int

    def terminate(self, timeout: float = 30.0) -> int: ...


class BenchRelay(ChildProcess):
    """`postbox relay run` with production defaults."""

    def __init__(
        self,
        s: BenchServers,
        extra: tuple[str, ...] = (),
        log_level: str = "info",
        env: dict[str, str] | None = None,
        code: Path | None = None,
    ) -> None:
        """code: a checkout whose postbox to run (a paired before/after benchmark), else this one."""
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
            env=env,
            log_level=log_level,
            cwd=code or REPO,
        )
        self.process_id = self.process.pid

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False


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


@contextlib.contextmanager
def publishing(
    s: BenchServers,
    tool: str,
    replicas: int = 1,
    relay_args: tuple[str, ...] = (),
    log_level: str = "info",
    env: dict[str, str] | None = None,
    code: Path | None = None,
) -> Iterator[list[Publisher]]:
    """`replicas` postbox relays (with `env` added to their environment, from the checkout `code` if
    given), or one Debezium worker, running and ready to publish new rows."""
    if tool == "postbox":
        relays = [BenchRelay(s, relay_args, log_level, env, code) for _ in range(replicas)]
        try:
            wait_until(lambda: all(r.ready() for r in relays), 60, interval=0.2, what="relays ready")
            if replicas > 1:
                time.sleep(6)  # let the replicas settle their shard split (leases rebalance every ttl / 3)
            yield list(relays)
        finally:
            for relay in relays:
                relay.__exit__()
        return
    debezium = DebeziumConnect(s.postgres.dsn, s.postgres.port, s.kafka.bootstrap, SCHEMA)
    try:
        wait_until(lambda: debezium.streaming(s.postgres.dsn), 180, interval=0.5, what="Debezium streaming")
        yield [debezium]
    finally:
        debezium.close(s.postgres.dsn)


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


def paced_writes(
    dsn: str, rate: float, seconds: float, write_one: Callable[[psycopg.Connection[Any], int], str]
) -> tuple[dict[str, float], float]:
    """WRITERS connections, each calling `write_one(conn, i)` (which commits one event and returns its id)
    at rate / WRITERS for `seconds`, i running over all writers' events. Returns when each event's commit
    returned (wall clock, by id) and how long the writers ran."""
    committed: dict[str, float] = {}

    def write(writer: int) -> None:
        with psycopg.connect(dsn) as conn:
            interval, next_at = WRITERS / rate, time.perf_counter()
            deadline, i = next_at + seconds, writer
            while time.perf_counter() < deadline:
                event_id = write_one(conn, i)
                committed[event_id] = time.time()
                i += WRITERS
                next_at += interval
                time.sleep(max(0.0, next_at - time.perf_counter()))

    writers = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    started = time.monotonic()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    return committed, time.monotonic() - started


class ReceiveTimes:
    """A plain consumer of `topic` (fetch.wait.max.ms 5, as a latency-minded consumer sets it) in a thread
    of its own: when each event arrived (wall clock), by the id `event_id` reads off the message. Entered
    once the consumer has its partitions (a broker just started can take seconds to load its group
    coordinator), so that the clock starts after that."""

    def __init__(
        self, bootstrap: str, topic: str, event_id: Callable[[confluent_kafka.Message], str]
    ) -> None:
        self.received: dict[str, float] = {}
        self._topic, self._event_id = topic, event_id
        self._stop, self._joined = threading.Event(), threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"latency-{uuid.uuid4().hex[:6]}",
                "auto.offset.reset": "earliest",  # a fresh topic: everything on it is this run's
                "fetch.wait.max.ms": 5,
                "fetch.min.bytes": 1,
            }
        )
        self._thread = threading.Thread(target=self._consume)

    def __enter__(self) -> ReceiveTimes:
        self._thread.start()
        if not self._joined.wait(60):
            self.__exit__()
            raise RuntimeError("the latency consumer got no partitions within 60 s")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._consumer.close()

    def _consume(self) -> None:
        self._consumer.subscribe([self._topic], on_assign=lambda *_: self._joined.set())
        while not self._stop.is_set():
            message = self._consumer.poll(0.05)
            if message is not None and not message.error():
                self.received[self._event_id(message)] = time.time()


def id_header(message: confluent_kafka.Message) -> str:
    """The event id a relay puts in each message's `id` header."""
    event_id = dict(message.headers() or [])["id"]
    assert isinstance(event_id, bytes)
    return event_id.decode()


@dataclass
class LatencyRun:
    latencies: list[float]  # ms from each writer's commit returning to a consumer receiving it, sorted
    peak_mb: float  # the publisher's
    cpu_seconds: float  # the publisher's, while the writers ran
    stages: dict[str, list[float]] | None = None  # ms per event and stage (postbox with breakdown=True)
    slowest: dict[str, float] | None = None  # the median of each stage over the slowest 1% of events
    relay_histogram: dict[float, float] | None = None  # commit_to_ack: share of events within each bound
    seconds: float = 0.0  # how long the writers ran


def bench_latency(
    s: BenchServers,
    rate: float,
    seconds: float,
    tool: str,
    payload: str,
    listen: bool = True,
    relay_args: tuple[str, ...] = (),
    breakdown: bool = False,
    env: dict[str, str] | None = None,
    sampled_every: int | None = None,
    mode: str = "queue",
    open_transaction: bool = False,
    code: Path | None = None,
) -> LatencyRun:
    """Writers commit one event per transaction at `rate`; each event's time from the commit returning to
    a consumer receiving it. With `breakdown` (postbox only) the relay runs at debug level, whose
    per-batch line gives each batch's wall-clock stages and rows, and each event's latency is split
    into its stages (see STAGES). mode: the outbox's and the relay's (postbox only). open_transaction: a
    transaction elsewhere that takes an id (and writes no outbox row) stays open while the writers run.
    code: a checkout whose relay to run (see BenchRelay)."""
    s.fresh_schema(mode)
    if tool == "postbox":
        relay_args = (*relay_args, "--mode", mode)
    aggregate_type, topic = s.fresh_topic("latency")

    def write_one(conn: psycopg.Connection[Any], i: int) -> str:
        event_id = enqueue(
            conn,
            aggregate_type,
            f"o-{i % 1000}",
            "Placed",
            {"pad": payload[:200]},
            writer_context(i, sampled_every),
        )
        conn.commit()
        return str(event_id)

    relay_args = (*relay_args, *(() if listen else ("--no-listen",)))
    log_level = "debug" if breakdown else "info"
    run: LatencyRun
    holder = psycopg.connect(s.postgres.dsn) if open_transaction else None
    try:
        with (
            publishing(s, tool, relay_args=relay_args, log_level=log_level, env=env, code=code) as publishers,
            ReceiveTimes(s.kafka.bootstrap, topic, id_header) as consumer,
        ):
            received = consumer.received
            _, cpu_before = process_usage(publishers[0].process_id)
            if holder is not None:
                holder.execute("SELECT pg_current_xact_id()")  # an id, in every snapshot's running list
            committed, writing = paced_writes(s.postgres.dsn, rate, seconds, write_one)
            wait_until(lambda: len(received) >= len(committed), 60, interval=0.2, what="every event received")
            peak, cpu = process_usage(publishers[0].process_id)
            run = LatencyRun(
                sorted((received[e] - committed[e]) * 1000 for e in committed),
                peak,
                cpu - cpu_before,
                seconds=writing,
            )
            relay = publishers[0]
            if isinstance(relay, BenchRelay):  # the relay's own view, to set beside the consumer's
                _, metrics = http_get(relay.metrics_port, "/metrics")
                run.relay_histogram = histogram_shares(metrics, "postbox_relay_commit_to_ack_seconds")
            publishers[0].terminate()
            if breakdown:
                assert isinstance(relay, BenchRelay)
                run.stages, run.slowest = latency_stages(s, relay.log(), committed, received)
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
    return run


# Each event's commit-to-consumer time, split at the relay's wall-clock stages (its debug line per batch):
STAGES = {
    "commit->claim start": "waits for a wake-up (NOTIFY) or for the lane's batch before it to be marked",
    "claim": "the claim statement",
    "produce->ack": "messages built, produced, linger.ms, the broker's acks (acks=all)",
    "ack->consumer": "the consumer's fetch (fetch.wait.max.ms 5) and delivery",
    "commit->ack": "the first three together: what postbox_relay_commit_to_ack_seconds measures",
    "mark+commit": "the mark statement and commit after the acks (delays the lane's next batch)",
}


def latency_stages(
    s: BenchServers, relay_log: str, committed: dict[str, float], received: dict[str, float]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    batches: dict[int, dict[str, float]] = {}
    for line in relay_log.splitlines():
        if '"relay_batch_published"' not in line:
            continue
        entry = json.loads(line)
        for row_id in entry["row_ids"]:
            batches[row_id] = entry
    with psycopg.connect(s.postgres.dsn) as conn:
        rows = conn.execute("SELECT id, event_id::text FROM postbox.outbox").fetchall()
    stages: dict[str, list[float]] = {stage: [] for stage in STAGES}
    per_event: list[tuple[float, dict[str, float]]] = []
    for row_id, event_id in rows:
        batch = batches.get(row_id)
        if batch is None or event_id not in committed or event_id not in received:
            continue
        commit = committed[event_id]
        parts = {
            "commit->claim start": max(0.0, batch["claim_started_at"] - commit),
            "claim": batch["claimed_at"] - batch["claim_started_at"],
            "produce->ack": batch["acked_at"] - batch["claimed_at"],
            "ack->consumer": received[event_id] - batch["acked_at"],
            "commit->ack": batch["acked_at"] - commit,
            "mark+commit": batch["committed_at"] - batch["acked_at"],
        }
        parts = {stage: value * 1000 for stage, value in parts.items()}
        for stage, value in parts.items():
            stages[stage].append(value)
        per_event.append(((received[event_id] - commit) * 1000, parts))
    per_event.sort(key=lambda item: item[0])
    tail = per_event[int(len(per_event) * 0.99) :]
    slowest = (
        {stage: statistics.median(parts[stage] for _, parts in tail) for stage in STAGES} if tail else {}
    )
    return {stage: sorted(values) for stage, values in stages.items()}, slowest


def histogram_shares(metrics: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative share of observations at each bucket bound."""
    counts: dict[float, float] = {}
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[float(bound)] = float(line.rsplit(" ", 1)[1])
    total = counts.get(float("inf"), 0.0)
    return {bound: count / total for bound, count in sorted(counts.items())} if total else {}


# The relay settings the latency breakdown varies (each against the defaults: linger.ms 5, 2 lanes,
# batch 1000).
LATENCY_VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("defaults              ", ()),
    ("linger.ms 1           ", ("--kafka-config", "linger.ms=1")),
    ("linger.ms 0           ", ("--kafka-config", "linger.ms=0")),
    ("1 lane                ", ("--lanes", "1")),
    ("batch 100             ", ("--batch-size", "100")),
)


def achieved(run: LatencyRun, seconds: float) -> str:
    return f"n={len(run.latencies)}, achieved {len(run.latencies) / seconds:,.0f}/s"


def quantiles(values: list[float]) -> str:
    return (
        f"p50 {percentile(values, 0.5):.1f}  p99 {percentile(values, 0.99):.1f}  "
        f"p999 {percentile(values, 0.999):.1f}"
    )


def share_within(values: list[float], bound: float) -> float:
    return sum(1 for v in values if v <= bound) / len(values) if values else 0.0


def histogram_quantile(shares: dict[float, float], q: float) -> float:
    """The q-quantile of a histogram, interpolated linearly inside its bucket (as Prometheus does)."""
    lower, below = 0.0, 0.0
    for bound, share in shares.items():
        if share >= q:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (q - below) / max(share - below, 1e-12)
        lower, below = bound, share
    return lower


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))]


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


WRK_SCRIPT = """\
-- Cycles through distinct, correctly signed Stripe events (generated by the benchmark). Each wrk thread
-- takes every THREADS-th request from its own offset, so no two threads send the same event.
local threads = 0
setup = function(thread)
  thread:set("offset", threads)
  threads = threads + 1
end
local requests = {}
local i = 0
init = function(args)
  for line in io.lines("%(requests)s") do
    local signature, body = line:match("^([^\\t]*)\\t(.*)$")
    requests[#requests + 1] = wrk.format("POST", "/webhooks/stripe",
      {["Content-Type"] = "application/json", ["Stripe-Signature"] = signature}, body)
  end
  i = offset
end
request = function()
  i = i + %(threads)d
  return requests[i %% #requests + 1]
end
"""


def signed_stripe_requests(events: int) -> Path:
    """A folder holding `events` distinct, correctly signed Stripe events and the wrk script that cycles
    through them (the caller removes it)."""
    folder = Path(tempfile.mkdtemp(prefix="postbox-wrk-"))
    now = int(time.time())
    with (folder / "requests.tsv").open("w") as out:
        for i in range(events):
            body = json.dumps(
                {
                    "id": f"evt_bench_{i}",
                    "object": "event",
                    "type": "payment_intent.succeeded",
                    "created": now,
                    "data": {"object": {"id": f"pi_{i}", "object": "payment_intent", "amount": 1000 + i}},
                }
            )
            out.write(f"{stripe_signature_header(STRIPE_SECRET, body.encode(), now)}\t{body}\n")
    (folder / "bench.lua").write_text(WRK_SCRIPT % {"requests": folder / "requests.tsv", "threads": 2})
    return folder


@dataclass
class WrkResult:
    rate: float  # requests/s
    answered_2xx: int
    p50_ms: float
    p99_ms: float
    cpu_seconds: float  # wrk's own


def run_wrk(url: str, folder: Path, connections: int, seconds: int) -> WrkResult:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is needed for the webhook benchmark: apt-get install wrk")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = subprocess.run(
        [wrk, "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(folder / "bench.lua"), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)

    def number(pattern: str) -> str:
        found = re.search(pattern, report, re.MULTILINE)
        if found is None:
            raise RuntimeError(f"wrk printed no {pattern!r}:\n{report}")
        return found.group(1)

    def milliseconds(text: str) -> float:
        value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit]

    total = int(number(r"(\d+) requests in"))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", report)
    return WrkResult(
        rate=float(number(r"Requests/sec:\s+([\d.]+)")),
        answered_2xx=total - (int(non_2xx.group(1)) if non_2xx else 0),
        p50_ms=milliseconds(number(r"^\s+50%\s+(\S+)")),
        p99_ms=milliseconds(number(r"^\s+99%\s+(\S+)")),
        cpu_seconds=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    )


@dataclass
class WebhookRun:
    wrk: WrkResult
    stored: int  # distinct events in the webhook inbox afterwards
    peak_mb: float  # the largest receiver process's peak RSS
    receiver_cpu: float  # seconds, all its processes, while wrk ran
    machine_cpu: float  # seconds, every process on the machine, while wrk ran


def workers_flag(workers: int) -> tuple[str, ...]:
    return ("--workers", str(workers)) if workers != 1 else ()


def receiver_cpu(receiver: ReceiverProcess) -> float:
    return sum(process_usage(pid)[1] for pid in receiver.process_tree())


def bench_webhooks(
    s: BenchServers, seconds: int, connections: int, events: int, workers: int = 1
) -> WebhookRun:
    """The receiver under wrk, every request a distinct Stripe event with a valid signature, so each is
    verified and inserted; afterwards, how many events the database holds."""
    s.fresh_schema()
    folder = signed_stripe_requests(events)
    try:
        with ReceiverProcess(s.postgres.dsn, SCHEMA, *workers_flag(workers), log_level="info") as receiver:
            cpu_before, machine_before = receiver_cpu(receiver), machine_busy_seconds()
            result = run_wrk(receiver.url, folder, connections, seconds)
            cpu, machine = receiver_cpu(receiver) - cpu_before, machine_busy_seconds() - machine_before
            peak = max(process_usage(pid)[0] for pid in receiver.process_tree())
            assert receiver.terminate() == 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with psycopg.connect(s.postgres.dsn) as conn:
        row = conn.execute("SELECT count(*) FROM postbox.webhook_inbox").fetchone()
    return WebhookRun(result, int(row[0]) if row else 0, peak, cpu, machine)


# pgbench reads :name as a variable even inside a string, hence chr(58) for the twin key's colons.
PGBENCH_INSERT = """\
\\set n random(1, 1000000000000)
INSERT INTO postbox.webhook_inbox (provider, event_id, event_type, payload, headers, twin_key)
SELECT 'stripe', 'evt_limit_' || n, 'payment_intent.succeeded',
       ('{"id": "evt_limit_' || n || '", "object": "event", "type": "payment_intent.succeeded", '
        '"created": 1800000000, "data": {"object": {"id": "pi_' || n || '", "object": "payment_intent", '
        '"amount": 1000}}}')::jsonb,
       '{}'::jsonb, concat_ws(chr(58), 'payment_intent.succeeded', 'pi_' || n, '0123456789abcdef')
FROM (SELECT CAST(:n AS bigint) AS n) AS chosen
ON CONFLICT DO NOTHING
RETURNING provider, event_id;
"""


def bench_webhook_insert_limit(s: BenchServers, connections: int, seconds: int) -> float:
    """Statements/s of the receiver's durable write with no HTTP and no Python: one Stripe-sized event
    per statement and per commit (autocommit), from `connections` pgbench clients."""
    s.fresh_schema()
    folder = Path(tempfile.mkdtemp(prefix="postbox-pgbench-"))
    try:
        (folder / "insert.sql").write_text(PGBENCH_INSERT)
        report = subprocess.run(
            [
                str(Path(find_bin_dir(), "pgbench")),
                "--no-vacuum",
                f"--client={connections}",
                "--jobs=2",
                f"--time={seconds}",
                "--protocol=prepared",
                f"--file={folder / 'insert.sql'}",
                s.postgres.dsn,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    found = re.search(r"tps = ([\d.]+)", report)
    if found is None:
        raise RuntimeError(f"pgbench printed no tps:\n{report}")
    return float(found.group(1))


def per_request(runs: list[WebhookRun], seconds: Callable[[WebhookRun], float]) -> str:
    """The median over runs of CPU microseconds per answered request."""
    return f"{statistics.median(seconds(r) / max(1, r.wrk.answered_2xx) for r in runs) * 1e6:.0f} us"


@dataclass
class TracingVariant:
    label: str
    env: dict[str, str]  # added to the relay's environment
    sampled_every: int | None = None  # the writers propagate a trace context, one in this many sampled


def tracing_variants(sink: OtlpReceiver, folder: Path) -> list[TracingVariant]:
    """The relay's environments for the tracing part: OpenTelemetry absent (an importable-looking package
    that refuses to import shadows it, as on a machine without postbox[otel]), installed but off (no
    OTEL_* variable), on with every span exported to `sink` or 1% of them by the relay's own sampler
    (rows without a writer's context); then rows that carry a writer's context (its traceparent header,
    1% of them sampled), with the relay's tracing off and on with the default parent-based sampler."""
    hidden = folder / "opentelemetry"
    hidden.mkdir(exist_ok=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the benchmark: no OpenTelemetry")\n')
    python_path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    return [
        TracingVariant("OpenTelemetry not installed     ", {"PYTHONPATH": python_path}),
        TracingVariant("installed, tracing off          ", {}),
        TracingVariant("on, always_on                   ", {**exporting, "OTEL_TRACES_SAMPLER": "always_on"}),
        TracingVariant("on, relay samples 1%            ", {**exporting, **ratio}),
        TracingVariant("off, writers' context in rows   ", {}, sampled_every=100),
        TracingVariant("on, writers sample 1% (default) ", exporting, sampled_every=100),
    ]


def bench_tracing(
    s: BenchServers, rows: int, runs: int, latency_seconds: float, relay_args: tuple[str, ...]
) -> None:
    """The relay's drain and latency with tracing absent, off and on, interleaved run by run so that the
    machine's drift falls on every variant alike; spans go to an OTLP/HTTP receiver in this process."""
    sink = OtlpReceiver(decode=False)
    payload = payload_of(200)
    try:
        with tempfile.TemporaryDirectory() as folder:
            variants = tracing_variants(sink, Path(folder))
            drains: dict[str, list[tuple[float, float, float, float]]] = {v.label: [] for v in variants}
            exported: dict[str, int] = dict.fromkeys(drains, 0)
            for _ in range(runs):
                for v in variants:
                    before = sink.span_count
                    drains[v.label].append(
                        bench_drain(s, rows, payload, "postbox", 1, relay_args, v.env, v.sampled_every)
                    )
                    exported[v.label] += sink.span_count - before  # the relay flushes its spans on exit
            for label, results in drains.items():
                print(
                    f"drain {label}: events/s {median_spread([r[0] for r in results])}; "
                    f"relay CPU {statistics.median(r[2] for r in results) / rows * 1e6:.0f} us per event, "
                    f"whole machine {statistics.median(r[3] for r in results):.1f} s; peak RSS "
                    f"{max(r[1] for r in results):.0f} MB; spans exported "
                    f"{exported[label] / (rows * runs):.1%} of messages",
                    flush=True,
                )
            for rate in (1000, 5000):
                latencies: dict[str, list[LatencyRun]] = {v.label: [] for v in variants}
                for _ in range(runs):
                    for v in variants:
                        latencies[v.label].append(
                            bench_latency(
                                s,
                                rate,
                                latency_seconds,
                                "postbox",
                                payload,
                                relay_args=relay_args,
                                env=v.env,
                                sampled_every=v.sampled_every,
                            )
                        )
                for label, measured in latencies.items():
                    p50 = [percentile(r.latencies, 0.5) for r in measured]
                    p99 = [percentile(r.latencies, 0.99) for r in measured]
                    core = statistics.median(r.cpu_seconds for r in measured) / latency_seconds
                    print(
                        f"{rate}/s {label}: commit->consumer p50 {median_spread(p50, 1)} ms, "
                        f"p99 {median_spread(p99, 1)} ms; relay CPU {core:.0%} of a core",
                        flush=True,
                    )
    finally:
        sink.close()


def repeat(runs: int, measure: Callable[[], float]) -> list[float]:
    return [measure() for _ in range(runs)]


PARTS = ("limits", "drain", "latency", "longtx", "tracing", "consumers", "webhooks")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument(
        "--relay-batch-size",
        type=int,
        help="the relays' --batch-size (default: theirs, which depends on the mode)",
    )
    parser.add_argument("--no-debezium", action="store_true", help="leave the peer out")
    parser.add_argument(
        "--payload-sizes", type=int, nargs="+", default=[200, 1024], help="limits and drain payloads, bytes"
    )
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts (repeatable)")
    parser.add_argument(
        "--webhook-processes", type=int, nargs="+", default=[1, 2], help="the receiver's --workers to measure"
    )
    args = parser.parse_args()
    parts = set(args.only or PARTS)

    # Started in the background a process ignores SIGINT; SIGTERM must still run the cleanup below (the
    # servers and processes the benchmark started would otherwise outlive it and skew the next run).
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    tools = ["postbox"] if args.no_debezium else ["postbox", "debezium"]
    postgres = LocalPostgres(
        find_bin_dir(), settings={"wal_level": "logical", "max_connections": "300"}
    ).start()
    kafka = LocalKafka(default_partitions=PARTITIONS).start()
    s = BenchServers(postgres, kafka)

    def say(line: str) -> None:
        print(line, flush=True)

    batch_shown = args.relay_batch_size or f"{QUEUE_BATCH_ROWS} (queue) / {LOG_BATCH_ROWS} (log)"
    try:
        say(
            f"setup: {os.cpu_count()} cores, Python {platform.python_version()}, PostgreSQL "
            f"{postgres.server_version()} (fsync on, wal_level=logical, max_connections 300, else defaults), "
            f"Kafka "
            f"{kafka_version()} (1 KRaft node, {PARTITIONS} partitions), librdkafka "
            f"{confluent_kafka.libversion()[0]}; relay defaults: batch {batch_shown}, acks=all, "
            f"idempotence, lz4, linger.ms 5, log level info; Debezium {debezium_version()} in Kafka Connect "
            f"{kafka_version()} standalone (pgoutput, outbox event router, heap -Xmx2G, producer lz4 + "
            f"linger.ms 5, otherwise Connect's defaults); backlog {args.rows:,} rows; {args.runs} runs each"
        )
        relay_args = ("--batch-size", str(args.relay_batch_size)) if args.relay_batch_size else ()
        for size in args.payload_sizes:
            payload = payload_of(size)
            if parts & {"limits", "drain"}:
                say(f"\n-- payload {size} bytes --")
            if "limits" in parts:
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
                produced = repeat(
                    args.runs, lambda p=payload: bench_raw_producer(s, min(args.rows, 500_000), p)[0]
                )
                say(f"limit: raw producer msgs/s              {median_spread(produced)}")
            if "drain" not in parts:
                continue
            drains = [
                ("postbox, 1 relay            ", "postbox", 1, relay_args, "queue"),
                ("postbox, 3 relays           ", "postbox", 3, relay_args, "queue"),
                ("postbox, 1 relay, delete    ", "postbox", 1, (*relay_args, "--delete-on-publish"), "queue"),
                ("postbox log, 1 relay        ", "postbox", 1, relay_args, "log"),
                ("postbox log, 3 relays       ", "postbox", 3, relay_args, "log"),
            ] + [("Debezium, 1 task            ", "debezium", 1, (), "queue")] * (len(tools) - 1)
            for who, tool, replicas, extra, mode in drains:
                results = [
                    bench_drain(s, args.rows, payload, tool, replicas, extra, mode=mode)
                    for _ in range(args.runs)
                ]
                say(
                    f"drain {who}: events/s {median_spread([r[0] for r in results])}; "
                    f"peak RSS per process {max(r[1] for r in results):.0f} MB; "
                    f"CPU while draining: publishers {statistics.median(r[2] for r in results):.1f} s, "
                    f"whole machine {statistics.median(r[3] for r in results):.1f} s"
                )
        if "latency" in parts:
            # A broker just started is slow to serve its first group and topic: warm it up, unmeasured.
            bench_latency(s, 1000, 5, "postbox", payload_of(200))
            say(f"\n-- steady state, 200-byte payloads, one event per transaction, {WRITERS} writers --")
            variants = [("postbox", True, "queue"), ("postbox", False, "queue"), ("postbox", True, "log")] + [
                ("debezium", True, "queue")
            ] * (len(tools) - 1)
            for rate in (1000, 5000):
                for tool, listen, mode in variants:
                    run = bench_latency(
                        s, rate, args.latency_seconds, tool, payload_of(200), listen, mode=mode
                    )
                    who = f"postbox, NOTIFY {'on ' if listen else 'off'}" if tool == "postbox" else "Debezium"
                    who = "postbox log, NOTIFY on" if mode == "log" else who
                    core = run.cpu_seconds / args.latency_seconds
                    say(
                        f"{rate}/s {who:18}: commit->consumer ms {quantiles(run.latencies)}  "
                        f"({achieved(run, args.latency_seconds)}; RSS {run.peak_mb:.0f} MB, "
                        f"CPU {core:.0%} of a core)"
                    )
            say(
                "\n-- where the time goes: postbox, NOTIFY on, the relay at debug level (its per-batch line "
                "gives each batch's wall-clock stages); ms per event --"
            )
            for stage, meaning in STAGES.items():
                say(f"   {stage:19} {meaning}")
            for rate in (1000, 5000):
                for label, extra in LATENCY_VARIANTS:
                    run = bench_latency(
                        s, rate, args.latency_seconds, "postbox", payload_of(200), True, extra, breakdown=True
                    )
                    assert run.stages is not None
                    assert run.slowest is not None
                    say(
                        f"{rate}/s, {label}: commit->consumer {quantiles(run.latencies)} "
                        f"({achieved(run, args.latency_seconds)})"
                    )
                    for stage, values in run.stages.items():
                        say(f"   {stage:19} {quantiles(values)}; the slowest 1%: {run.slowest[stage]:.1f}")
                    acked = run.stages["commit->ack"]
                    shares = run.relay_histogram or {}
                    say(
                        "   commit->ack within 50 ms / 100 ms: the relay's histogram "
                        f"{shares.get(0.05, 0):.2%} / {shares.get(0.1, 0):.2%}, measured here "
                        f"{share_within(acked, 50):.2%} / {share_within(acked, 100):.2%}; p99 from the "
                        f"histogram {histogram_quantile(shares, 0.99) * 1000:.0f} ms (bucket-interpolated), "
                        f"measured here {percentile(acked, 0.99):.1f} ms"
                    )
        if "longtx" in parts:
            seconds, rate = 60.0, 200
            say(
                f"\n-- a transaction elsewhere holding an id (no outbox row) open for a whole "
                f"{seconds:.0f} s run against none, {rate} events/s, NOTIFY on, runs interleaved; ms from "
                "commit to consumer --"
            )
            bench_latency(s, 1000, 5, "postbox", payload_of(200), mode="log")  # warm-up, unmeasured
            for mode in ("log", "queue"):
                by_held: dict[bool, list[LatencyRun]] = {False: [], True: []}
                for _ in range(args.runs):
                    for held in (False, True):
                        by_held[held].append(
                            bench_latency(
                                s, rate, seconds, "postbox", payload_of(200), mode=mode, open_transaction=held
                            )
                        )
                for held, measured in by_held.items():
                    say(
                        f"{mode:5} mode, {'one held open' if held else 'none open    '}: p50 "
                        f"{median_spread([percentile(r.latencies, 0.5) for r in measured], 1)}, p99 "
                        f"{median_spread([percentile(r.latencies, 0.99) for r in measured], 1)}, max "
                        f"{median_spread([r.latencies[-1] for r in measured], 1)} "
                        f"({achieved(measured[0], seconds)})"
                    )
        if "tracing" in parts:
            rows = min(args.rows, 300_000)
            say(
                f"\n-- tracing: the relay with OpenTelemetry absent, off and on (spans over OTLP/HTTP to a "
                f"receiver in the benchmark's process, the SDK's default batch processor); drain of {rows:,} "
                f"rows of 200 bytes, and steady state as above; rows without a trace context unless the "
                f"variant names the writers'; runs interleaved --"
            )
            bench_tracing(s, rows, args.runs, args.latency_seconds, relay_args)
        if "consumers" in parts:
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
        if "webhooks" in parts:
            say(
                "\n-- webhook receiver: distinct Stripe events, each signature checked, each stored before "
                "its 200; wrk 2 threads, 15 s per run --"
            )
            for connections in WEBHOOK_CONNECTIONS:
                limits = repeat(args.runs, lambda c=connections: bench_webhook_insert_limit(s, c, 10))
                say(
                    f"limit: one-event insert+commit/s, {connections:3} connections, no HTTP (pgbench) "
                    f"{median_spread(limits)}"
                )
            for workers in args.webhook_processes:
                for connections in WEBHOOK_CONNECTIONS:
                    runs = [bench_webhooks(s, 15, connections, 100_000, workers) for _ in range(args.runs)]
                    served = sum(r.wrk.answered_2xx for r in runs)
                    # Each request is a distinct event, so every 2xx must have left a row (more rows than
                    # answers is fine: requests still in flight when wrk stopped were stored unanswered).
                    lost = sum(max(0, r.wrk.answered_2xx - r.stored) for r in runs)
                    say(
                        f"{workers} process{'es' if workers > 1 else '  '}, {connections:3} connections: "
                        f"requests/s {median_spread([r.wrk.rate for r in runs])}; "
                        f"p50 {statistics.median(r.wrk.p50_ms for r in runs):.1f} ms, "
                        f"p99 {median_spread([r.wrk.p99_ms for r in runs], 1)} ms; "
                        f"CPU per request: receiver {per_request(runs, lambda r: r.receiver_cpu)}, "
                        f"wrk {per_request(runs, lambda r: r.wrk.cpu_seconds)}, "
                        f"whole machine {per_request(runs, lambda r: r.machine_cpu)}; "
                        f"peak RSS {max(r.peak_mb for r in runs):.0f} MB; "
                        f"{served:,} answered 2xx in the {len(runs)} run(s), {lost} of them not stored"
                    )
    finally:
        kafka.stop()
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
