"""The "latency" part (`python -m tests.bench.run --only latency`), steady state: writers committing one event
per transaction at fixed rates, latency from the writer's commit returning to a consumer receiving the
message (so it includes the consumer's fetch; the broker's ack comes earlier): postbox with NOTIFY on and
off, postbox in log mode, and Debezium; resident memory (peak) and CPU seconds of each publishing process.
Then where the time goes: the relay at debug level, each event's latency split at its batch's wall-clock
stages (STAGES), for the defaults and the variants in LATENCY_VARIANTS. On the servers tests.bench.run
starts (tests.bench.harness.servers)."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from postbox.relay.outbox import enqueue
from tests.bench.harness.servers import BenchRelay, BenchServers, process_usage, publishing
from tests.bench.harness.stats import (
    histogram_quantile,
    histogram_shares,
    percentile,
    quantiles,
    share_within,
)
from tests.bench.harness.traffic import (
    WRITERS,
    ReceiveTimes,
    id_header,
    paced_writes,
    payload_of,
    writer_context,
)
from tests.support.probes import http_get
from tests.support.waiting import wait_until


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


def run_part(s: BenchServers, args: argparse.Namespace, tools: list[str], say: Callable[[str], None]) -> None:
    """The steady-state latencies of each tool in `tools`, then the breakdown by stage."""
    # A broker just started is slow to serve its first group and topic: warm it up, unmeasured.
    bench_latency(s, 1000, 5, "postbox", payload_of(200))
    say(f"\n-- steady state, 200-byte payloads, one event per transaction, {WRITERS} writers --")
    variants = [("postbox", True, "queue"), ("postbox", False, "queue"), ("postbox", True, "log")] + [
        ("debezium", True, "queue")
    ] * (len(tools) - 1)
    for rate in (1000, 5000):
        for tool, listen, mode in variants:
            run = bench_latency(s, rate, args.latency_seconds, tool, payload_of(200), listen, mode=mode)
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
