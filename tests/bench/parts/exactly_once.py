"""The "exactly_once" part (`python -m tests.bench.run --only exactly_once`): one log-mode relay with and
without --exactly-once, run after run in turn on the same servers: the drain of a backlog (--rows, 1,000,000
by default; from the commit until every shard's cursor has passed it, which with --exactly-once comes
after each batch's Kafka commit), and the steady state at 1,000 events/s (commit to a read_committed
consumer: librdkafka's default isolation, the one that sees each event once). The issue's targets: the drain
within 20% of the relay without it, p99 under 100 ms."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from tests.bench.harness.servers import BenchServers
from tests.bench.harness.stats import median_spread, percentile
from tests.bench.harness.traffic import payload_of
from tests.bench.parts.drain import bench_drain
from tests.bench.parts.latency import LatencyRun, bench_latency

VARIANTS = {"at-least-once": (), "--exactly-once": ("--exactly-once",)}
RATE = 1000


def run_part(
    s: BenchServers, args: argparse.Namespace, relay_args: tuple[str, ...], say: Callable[[str], None]
) -> None:
    payload = payload_of(200)
    say(
        f"\n-- exactly-once: one relay in log mode, without and with --exactly-once, runs interleaved; "
        f"drain of {args.rows:,} rows of 200 bytes; steady state {RATE}/s for {args.latency_seconds:g} s, "
        f"commit to a read_committed consumer --"
    )
    drains: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    machine: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):
        for label, extra in VARIANTS.items():
            rate, _rss, relay_cpu, machine_cpu = bench_drain(
                s, args.rows, payload, "postbox", 1, (*relay_args, *extra), mode="log"
            )
            drains[label].append(rate)
            cpu[label].append(relay_cpu / args.rows * 1e6)
            machine[label].append(machine_cpu / args.rows * 1e6)
    base = statistics.median(drains["at-least-once"])
    for label in VARIANTS:
        ratios = [r / base for r in drains[label]]
        say(
            f"drain {label:>15}: events/s {median_spread(drains[label])}; ratio to at-least-once "
            f"{median_spread(ratios, 2)}; CPU per event: relay {statistics.median(cpu[label]):.0f} us, whole "
            f"machine {statistics.median(machine[label]):.0f} us"
        )
    bench_latency(s, RATE, 5, "postbox", payload, mode="log")  # warm-up, unmeasured
    latencies: dict[str, list[LatencyRun]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):
        for label, extra in VARIANTS.items():
            latencies[label].append(
                bench_latency(
                    s,
                    RATE,
                    args.latency_seconds,
                    "postbox",
                    payload,
                    relay_args=(*relay_args, *extra),
                    mode="log",
                )
            )
    for label, runs in latencies.items():
        p50 = [percentile(r.latencies, 0.5) for r in runs]
        p99 = [percentile(r.latencies, 0.99) for r in runs]
        core = statistics.median(r.cpu_seconds for r in runs) / args.latency_seconds
        say(
            f"{RATE}/s {label:>15}: commit->consumer p50 {median_spread(p50, 1)} ms, p99 "
            f"{median_spread(p99, 1)} ms; relay CPU {core:.0%} of a core"
        )
