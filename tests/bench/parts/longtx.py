"""The "longtx" part (`python -m tests.bench.run --only longtx`): log mode's and queue mode's steady-state
latency (200 events/s for 60 s) with a transaction elsewhere that holds an id open for the whole run,
against none, runs interleaved. On the servers tests.bench.run starts (tests.bench.harness.servers)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tests.bench.harness.servers import BenchServers
from tests.bench.harness.stats import median_spread, percentile
from tests.bench.harness.traffic import payload_of
from tests.bench.parts.latency import LatencyRun, achieved, bench_latency


def run_part(s: BenchServers, args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """Latency with and without a transaction held open, in log and queue mode."""
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
