"""postbox benchmarks, on servers of their own, against the limits of this machine and against Debezium
(not a test: it prints figures and the setup that produced them).

    python -m tests.bench.run                       # everything below, 3 runs each, medians with the spread
    python -m tests.bench.run --rows 100000 --runs 1   # a quick look
    python -m tests.bench.run --only drain --only peer # some parts only

Measured, in one run on the same servers (PostgreSQL runs with wal_level=logical throughout, which
Debezium needs, so both tools see the same database):
- limits: single-row-commit insert rate of a writer (into a queue-mode and a log-mode outbox); the relay's
  own claim+mark SQL with no Kafka, and log mode's read (the relay's own log source: windows, pages and
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
  distinct);
- capture: writers on a captured table against the same table uncaptured (single-row commits, and a bulk
  INSERT), and the drain of captured changes by postbox against Debezium's plain change events;
- exactly_once: one log-mode relay with and without --exactly-once: the drain of --rows, and the steady
  state at 1,000 events/s (commit to a read_committed consumer).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal

import confluent_kafka

from postbox.relay.devstack.kafka import LocalKafka, kafka_version
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from postbox.relay.outbox.settings import LOG_BATCH_ROWS, QUEUE_BATCH_ROWS
from tests.bench.harness.servers import PARTITIONS, BenchServers
from tests.bench.harness.traffic import payload_of
from tests.bench.parts import (
    capture,
    consumers,
    drain,
    exactly_once,
    latency,
    limits,
    longtx,
    tracing,
    webhooks,
)
from tests.debezium import debezium_version

PARTS = (
    "limits",
    "drain",
    "latency",
    "longtx",
    "tracing",
    "consumers",
    "webhooks",
    "capture",
    "exactly_once",
)


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
    parser.add_argument(
        "--capture-rows", type=int, default=100_000, help="capture: bulk INSERT and drain rows"
    )
    parser.add_argument(
        "--capture-commits", type=int, default=2000, help="capture: single-row commits per run"
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
                limits.run_part(s, args, payload, say)
            if "drain" in parts:
                drain.run_part(s, args, payload, tools, relay_args, say)
        if "latency" in parts:
            latency.run_part(s, args, tools, say)
        if "longtx" in parts:
            longtx.run_part(s, args, say)
        if "tracing" in parts:
            tracing.run_part(s, args, relay_args, say)
        if "consumers" in parts:
            consumers.run_part(s, args, say)
        if "webhooks" in parts:
            webhooks.run_part(s, args, say)
        if "capture" in parts:
            capture.run_part(s, args, tools, say)
        if "exactly_once" in parts:
            exactly_once.run_part(s, args, relay_args, say)
    finally:
        kafka.stop()
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
