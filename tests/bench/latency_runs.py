"""Commit-to-consumer latency the way a user meets it (issue 39): every run on its own, from the first second.

    python -m tests.bench.latency_runs                    # the whole part: about 35 minutes here
    python -m tests.bench.latency_runs --runs 2 --rates 1000 --modes log --seconds 10
    python -m tests.bench.latency_runs --parts warm drain --compare /tmp/before   # paired with that checkout
    python -m tests.bench.latency_runs --parts warm drain --modes log --relay-args="--lanes 4" --compare-args=

Two parts, each run printed on its own line (not only the median run):
- `fresh`: every run on servers just started (a new PostgreSQL and a new Kafka broker), as a new environment
  meets postbox: a relay with the defaults, started once the servers answer.
- `warm`: one pair of servers for the part, warmed by one run that is not counted; then every run with a new
  outbox schema, a new topic and a new relay, as a rolling deploy meets it.
In each run 4 writers commit one event per transaction at the rate asked for --seconds, each event's time
from its commit returning to a plain consumer (fetch.wait.max.ms 5) receiving it is taken; the relay's own
histogram (postbox_relay_commit_to_ack_seconds, commit to the broker's ack) is printed beside it. The
targets (issue 39, log mode at 1,000 events/s): p99 under 50 ms in every fresh run, under 25 ms in every
warm run.

Paired: with --compare DIR (a checkout of postbox, e.g. `git worktree add /tmp/before HEAD~1`) or
--compare-args ARGS (relay arguments), every warm run is made twice, with that relay ("before") and with
this checkout's, with --relay-args ("after"), in alternating order, and the ratios are printed; the `drain`
part (paired only) drains a backlog with each, alternately, per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shlex
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka
import psycopg
from confluent_kafka import Producer

from postbox.relay.devstack.kafka import LocalKafka, kafka_version
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from tests.bench.harness.servers import PARTITIONS, BenchServers, machine_busy_seconds
from tests.bench.harness.stats import histogram_quantile, percentile
from tests.bench.harness.traffic import WRITERS, ReceiveTimes, paced_writes, payload_of
from tests.bench.parts.drain import bench_drain
from tests.bench.parts.latency import LatencyRun, bench_latency
from tests.support.waiting import wait_until

TARGETS_MS = {"fresh": 50.0, "warm": 25.0}  # p99, log mode at 1,000 events/s (issue 39)
TARGET_MODE, TARGET_RATE = "log", 1000.0


@contextlib.contextmanager
def servers() -> Iterator[BenchServers]:
    postgres = LocalPostgres(find_bin_dir(), settings={"wal_level": "logical", "max_connections": "300"})
    postgres.start()
    try:
        kafka = LocalKafka(default_partitions=PARTITIONS).start()
        try:
            yield BenchServers(postgres, kafka)
        finally:
            # Kafka clients the run left for the garbage collector (an AdminClient in a reference cycle) would
            # retry the stopped broker, and print so, for the rest of the benchmark.
            gc.collect()
            kafka.stop()
    finally:
        postgres.stop()


@dataclass(frozen=True)
class Figures:
    n: int
    p50: float
    p99: float
    p999: float
    max: float
    relay_p99: float | None  # from the relay's histogram, interpolated in its bucket
    relay_cpu: float  # the relay's CPU, as a share of one core, while the writers ran
    machine_busy: float  # the whole machine's CPU in use (every core), as a share, over the run

    @classmethod
    def of(cls, run: LatencyRun, machine_busy: float) -> Figures:
        values = run.latencies
        relay = histogram_quantile(run.relay_histogram, 0.99) * 1000 if run.relay_histogram else None
        return cls(
            len(values),
            percentile(values, 0.5),
            percentile(values, 0.99),
            percentile(values, 0.999),
            values[-1],
            relay,
            run.cpu_seconds / run.seconds,
            machine_busy,
        )

    def line(self) -> str:
        relay = f"{self.relay_p99:6.1f}" if self.relay_p99 is not None else "     -"
        return (
            f"n={self.n:6} p50 {self.p50:6.1f} p99 {self.p99:6.1f} p999 {self.p999:7.1f} max {self.max:7.1f}"
            f" | relay p99 {relay}, relay CPU {self.relay_cpu:4.0%} of a core, machine busy "
            f"{self.machine_busy:4.0%}"
        )


def measure(s: BenchServers, mode: str, rate: float, seconds: float, relay: Variant | None = None) -> Figures:
    """One run of `mode`: a relay's (log, queue), or `direct`, the floor with no relay (bench_direct)."""
    relay = relay or Variant(None, ())
    cores = os.cpu_count() or 1
    busy, started = machine_busy_seconds(), time.monotonic()
    if mode == "direct":
        run = bench_direct(s, rate, seconds)
    else:
        run = bench_latency(
            s,
            rate,
            seconds,
            "postbox",
            payload_of(200),
            relay_args=relay.relay_args,
            mode=mode,
            code=relay.code,
        )
    return Figures.of(run, (machine_busy_seconds() - busy) / (cores * (time.monotonic() - started)))


def bench_direct(s: BenchServers, rate: float, seconds: float) -> LatencyRun:
    """The floor under any relay on these servers: the same writers commit the same rows (to a plain table,
    one per transaction) and, right after each commit, produce the event themselves with the relay's
    producer settings, so no relay reads, waits or marks. Commit to consumer, as bench_latency takes it."""
    _, topic = s.fresh_topic("floor")
    with psycopg.connect(s.postgres.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS latency_floor")
        conn.execute(
            "CREATE TABLE latency_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body jsonb)"
        )
    stop = threading.Event()
    # The relay's producer defaults (postbox relay run --help): acks=all, idempotence, lz4, linger.ms 5.
    producer = Producer(
        {
            "bootstrap.servers": s.kafka.bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "compression.type": "lz4",
            "linger.ms": 5,
        }
    )

    def serve_producer() -> None:
        while not stop.is_set():
            producer.poll(0.05)

    body = payload_of(200)

    def write_one(conn: psycopg.Connection[Any], i: int) -> str:
        conn.execute("INSERT INTO latency_floor (body) VALUES (%s::jsonb)", (body,))
        conn.commit()
        event_id = str(i)
        producer.produce(topic, key=event_id.encode(), value=body.encode())  # queued: it returns at once
        return event_id

    serving = threading.Thread(target=serve_producer)
    serving.start()
    try:
        with ReceiveTimes(s.kafka.bootstrap, topic, lambda m: (m.key() or b"").decode()) as consumer:
            received = consumer.received
            committed, writing = paced_writes(s.postgres.dsn, rate, seconds, write_one)
            producer.flush(30)
            wait_until(lambda: len(received) >= len(committed), 60, interval=0.2, what="every event received")
    finally:
        stop.set()
        serving.join()
    latencies = sorted((received[e] - committed[e]) * 1000 for e in committed)
    return LatencyRun(latencies, 0.0, 0.0, seconds=writing)


def verdict(part: str, mode: str, rate: float, p99s: list[float]) -> str:
    if (mode, rate) != (TARGET_MODE, TARGET_RATE) or part not in TARGETS_MS:
        return ""
    target = TARGETS_MS[part]
    met = sum(1 for p in p99s if p < target)
    outcome = "met" if met == len(p99s) else "not met"
    return f"  target p99 < {target:.0f} ms: {met} of {len(p99s)} runs ({outcome})"


def summary(part: str, results: dict[tuple[str, float], list[Figures]]) -> None:
    print(f"\n== {part}: per mode and rate, p99 of each run (ms) and the median of p50/p99/p999 ==")
    for (mode, rate), runs in results.items():
        p99s = [f.p99 for f in runs]
        print(
            f"   {mode:5} {rate:6.0f}/s  p99s {', '.join(f'{p:.1f}' for p in p99s)}; median p50 "
            f"{statistics.median(f.p50 for f in runs):.1f}, p99 {statistics.median(p99s):.1f}, p999 "
            f"{statistics.median(f.p999 for f in runs):.1f}" + verdict(part, mode, rate, p99s),
            flush=True,
        )


def fresh_part(args: argparse.Namespace) -> None:
    print("\n== fresh: every run on servers just started ==", flush=True)
    results: dict[tuple[str, float], list[Figures]] = {}
    for number in range(1, args.runs + 1):
        for mode in args.modes:
            for rate in args.rates:
                with servers() as s:
                    figures = measure(s, mode, rate, args.seconds, variants(args)[0])
                results.setdefault((mode, rate), []).append(figures)
                print(f"   run {number} {mode:5} {rate:6.0f}/s  {figures.line()}", flush=True)
    summary("fresh", results)


@dataclass(frozen=True)
class Variant:
    """A relay to measure: a checkout's code (None: this one) and extra `postbox relay run` arguments."""

    code: Path | None
    relay_args: tuple[str, ...]

    def describe(self) -> str:
        code = f"{self.code}'s relay" if self.code is not None else "this checkout's relay"
        return code + (f" with {shlex.join(self.relay_args)}" if self.relay_args else "")


def variants(args: argparse.Namespace) -> tuple[Variant, Variant | None]:
    """(after, before): this checkout's relay with --relay-args, and the relay it is paired with (None when
    neither --compare nor --compare-args is given)."""
    after = Variant(None, tuple(shlex.split(args.relay_args)))
    if args.compare is None and args.compare_args is None:
        return after, None
    return after, Variant(args.compare, tuple(shlex.split(args.compare_args or "")))


def warm_part(args: argparse.Namespace) -> None:
    after, before = variants(args)
    paired = f"; paired: before = {before.describe()}, after = {after.describe()}" if before else ""
    print(f"\n== warm: one pair of servers; each run a new schema, topic and relay{paired} ==", flush=True)
    results: dict[str, dict[tuple[str, float], list[Figures]]] = {"after": {}, "before": {}}
    with servers() as s:
        warmup = measure(s, args.modes[0], args.rates[0], args.seconds, after)
        print(f"   warm-up (not counted) {args.modes[0]} {args.rates[0]:.0f}/s  {warmup.line()}", flush=True)
        for number in range(1, args.runs + 1):
            for mode in args.modes:
                for rate in args.rates:
                    # Alternate which goes first, so neither always runs on the servers the other warmed.
                    order = (
                        [("before", before), ("after", after)] if before is not None else [("after", after)]
                    )
                    if number % 2 == 0:
                        order.reverse()
                    for label, variant in order:
                        assert variant is not None
                        figures = measure(s, mode, rate, args.seconds, variant)
                        results[label].setdefault((mode, rate), []).append(figures)
                        shown = f"{label:6} " if before is not None else ""
                        print(f"   run {number} {shown}{mode:6} {rate:6.0f}/s  {figures.line()}", flush=True)
    summary("warm", results["after"])
    if before is not None:
        summary("warm, before", results["before"])
        print("\n== warm, paired: after / before, per run ==")
        for key, runs in results["after"].items():
            pairs = list(zip(runs, results["before"][key], strict=True))
            for name in ("p50", "p99", "p999"):
                ratios = [getattr(a, name) / getattr(b, name) for a, b in pairs]
                print(
                    f"   {key[0]:6} {key[1]:6.0f}/s {name:5} ratios {', '.join(f'{r:.2f}' for r in ratios)}; "
                    f"median {statistics.median(ratios):.2f}"
                )


def drain_part(args: argparse.Namespace) -> None:
    """Paired: the drain of a backlog by the two variants, alternately, per mode."""
    after, before = variants(args)
    assert before is not None
    print(
        f"\n== drain: {args.drain_rows:,} rows of about 200 bytes; before = {before.describe()}, after = "
        f"{after.describe()}, alternately; one pair of servers ==",
        flush=True,
    )
    payload = payload_of(200)
    with servers() as s:
        for mode in args.modes:
            if mode == "direct":
                continue
            rates: dict[str, list[float]] = {"before": [], "after": []}
            for number in range(1, args.drain_rounds + 1):
                order = [("before", before), ("after", after)]
                if number % 2 == 0:
                    order.reverse()
                for label, variant in order:
                    rate = bench_drain(
                        s,
                        args.drain_rows,
                        payload,
                        "postbox",
                        1,
                        variant.relay_args,
                        mode=mode,
                        code=variant.code,
                    )[0]
                    rates[label].append(rate)
                    print(f"   round {number} {label:6} {mode:5} {rate:9,.0f} events/s", flush=True)
            ratios = [a / b for a, b in zip(rates["after"], rates["before"], strict=True)]
            print(
                f"   {mode:5} after/before ratios {', '.join(f'{r:.2f}' for r in ratios)}; median "
                f"{statistics.median(ratios):.2f} (median before {statistics.median(rates['before']):,.0f}, "
                f"after {statistics.median(rates['after']):,.0f} events/s)",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rates", type=float, nargs="+", default=[1000.0, 5000.0])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["log", "queue", "direct"],
        choices=("log", "queue", "direct"),
        help="direct: no relay, the writers produce each event after their commit (the floor)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="writing time per run")
    parser.add_argument("--parts", nargs="+", default=["fresh", "warm"], choices=("fresh", "warm", "drain"))
    parser.add_argument(
        "--compare", type=Path, help="a checkout whose relay to pair with this one's (warm, drain)"
    )
    parser.add_argument(
        "--compare-args",
        help="`postbox relay run` arguments of the relay paired with this one's (warm, drain)",
    )
    parser.add_argument("--relay-args", default="", help="extra `postbox relay run` arguments of this one's")
    parser.add_argument("--drain-rows", type=int, default=100_000)
    parser.add_argument("--drain-rounds", type=int, default=3)
    args = parser.parse_args()

    def stop(signum: int, frame: object) -> None:  # so that the servers started are stopped (finally)
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    if "drain" in args.parts and args.compare is None and args.compare_args is None:
        parser.error("--parts drain compares two relays: give --compare or --compare-args")
    if args.compare is not None and not (args.compare / "postbox" / "__main__.py").is_file():
        parser.error(f"--compare {args.compare}: no postbox checkout there (postbox/__main__.py)")
    print(
        f"setup: {os.cpu_count()} cores, Python {platform.python_version()}, Kafka {kafka_version()} "
        f"(1 KRaft node, {PARTITIONS} partitions), librdkafka {confluent_kafka.libversion()[0]}, "
        f"PostgreSQL with fsync on, wal_level=logical; one relay with the defaults (log level info); "
        f"{WRITERS} writers, one event "
        f"(about 200 bytes) per transaction, {args.seconds:.0f} s a run; a plain consumer, "
        f"fetch.wait.max.ms 5; latencies in ms",
        flush=True,
    )
    parts = {"fresh": fresh_part, "warm": warm_part, "drain": drain_part}
    for part in args.parts:
        parts[part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
