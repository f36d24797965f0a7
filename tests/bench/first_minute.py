"""The first minute of a relay, window by window (issue 39): where the latency tail of a fresh start goes.

    python -m tests.bench.first_minute                       # fresh servers, then a fresh relay on them
    python -m tests.bench.first_minute --seconds 30 --phases fresh warm warm-keep

Starts its own PostgreSQL (with pg_stat_statements) and Kafka like tests.bench.run, then per phase: one
relay with the defaults (log mode, at debug level for its per-batch and per-lease-turn lines), writers
committing one event per transaction at --rate for --seconds, and a plain consumer (fetch.wait.max.ms 5).
Phases: `fresh` (the first, on servers just started), `warm` (a fresh schema and relay on the same
servers), `warm-keep` (the schema and tables of the phase before, a fresh relay). Each window of
--window seconds (by commit time) shows the commit -> consumer latency and what happened in it: the
relay's batches (its slowest stages and the longest pause between two claims), its lease turns (the
housekeeping between batches, per step), PostgreSQL's slowest statements (pg_stat_statements, reset at
each window), autovacuum and analyze runs, checkpoints, and wait events sampled every 100 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from postbox.relay.devstack.kafka import LocalKafka
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from postbox.relay.outbox import enqueue
from tests.bench.harness.servers import PARTITIONS, BenchRelay, BenchServers, publishing
from tests.bench.harness.stats import histogram_quantile, histogram_shares, percentile
from tests.bench.harness.traffic import WRITERS, ReceiveTimes, id_header, paced_writes, payload_of
from tests.bench.parts.latency import STAGES, latency_stages
from tests.support.probes import http_get


@dataclass
class Window:
    latencies: list[float] = field(default_factory=list)
    batches: int = 0
    claim_ms: float = 0.0  # the slowest claim (lock + read)
    ack_ms: float = 0.0  # the slowest produce -> ack
    mark_ms: float = 0.0  # the slowest mark + commit
    gap_ms: float = 0.0  # the longest time no claim started
    lease_turns: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)
    waits: Counter[str] = field(default_factory=Counter)


class Sampler:
    """PostgreSQL seen from outside while a phase runs: wait events every 100 ms, autovacuum and
    checkpoints every second, pg_stat_statements at each window's end (then reset)."""

    def __init__(self, dsn: str, start: float, window: float, windows: dict[int, Window]) -> None:
        self._dsn, self._start, self._window, self._windows = dsn, start, window, windows
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _at(self, when: float) -> Window:
        return self._windows.setdefault(int((when - self._start) // self._window), Window())

    def _run(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
            counts = self._table_counts(conn)
            checkpoints = self._checkpoints(conn)
            next_second = next_window = time.time()
            next_window = self._start + self._window
            while not self._stop.wait(0.1):
                now = time.time()
                window = self._at(now)
                for backend, app, event, text in conn.execute(
                    """SELECT backend_type, application_name, wait_event_type || ':' || wait_event,
                              left(regexp_replace(query, '\\s+', ' ', 'g'), 70)
                       FROM pg_stat_activity
                       WHERE pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'
                         AND (wait_event IS NOT NULL OR backend_type = 'autovacuum worker')
                         AND backend_type IN ('client backend', 'autovacuum worker')"""
                ):
                    if backend == "autovacuum worker":
                        window.waits[f"autovacuum: {text}"] += 1
                    else:
                        who = "relay" if app == "postbox" else "writer"
                        window.waits[f"{who} {event}"] += 1
                if now >= next_second:
                    next_second = now + 1.0
                    counts_now = self._table_counts(conn)
                    for table, (vacuums, analyzes) in counts_now.items():
                        before = counts.get(table, (0, 0))
                        if vacuums > before[0]:
                            window.notes.append(f"{_clock(now, self._start)} autovacuum {table}")
                        if analyzes > before[1]:
                            window.notes.append(f"{_clock(now, self._start)} autoanalyze {table}")
                    counts = counts_now
                    checkpoints_now = self._checkpoints(conn)
                    if checkpoints_now != checkpoints:
                        window.notes.append(f"{_clock(now, self._start)} checkpoint")
                    checkpoints = checkpoints_now
                if now >= next_window:
                    ended = self._at(next_window - self._window / 2)
                    next_window += self._window
                    ended.statements = self._statements(conn)
                    conn.execute("SELECT pg_stat_statements_reset()")

    @staticmethod
    def _table_counts(conn: psycopg.Connection[tuple[Any, ...]]) -> dict[str, tuple[int, int]]:
        return {
            str(name): (int(v), int(a))
            for name, v, a in conn.execute(
                """SELECT relname, autovacuum_count, autoanalyze_count FROM pg_stat_user_tables
                   WHERE schemaname = 'postbox'"""
            )
        }

    @staticmethod
    def _checkpoints(conn: psycopg.Connection[tuple[Any, ...]]) -> int:
        row = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _statements(conn: psycopg.Connection[tuple[Any, ...]]) -> list[str]:
        """The statements of the window whose slowest call took 20 ms or more, slowest first."""
        return [
            f"max {maximum:.0f} ms (calls {calls}, mean {mean:.1f}): {text}"
            for maximum, calls, mean, text in conn.execute(
                """SELECT max_exec_time, calls, mean_exec_time,
                          left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
                   FROM pg_stat_statements
                   WHERE max_exec_time >= 20 AND query NOT LIKE '%pg_stat_%'
                   ORDER BY max_exec_time DESC LIMIT 4"""
            )
        ]


def _clock(when: float, start: float) -> str:
    return f"+{when - start:5.1f}s"


def run_phase(
    s: BenchServers,
    rate: float,
    seconds: float,
    window: float,
    fresh_schema: bool,
    relay_args: tuple[str, ...] = (),
) -> dict[int, Window]:
    if fresh_schema:
        s.fresh_schema("log")
    aggregate_type, topic = s.fresh_topic("minute")
    payload = payload_of(200)

    def write_one(conn: psycopg.Connection[Any], i: int) -> str:
        event_id = enqueue(conn, aggregate_type, f"o-{i % 1000}", "Placed", {"pad": payload[:200]})
        conn.commit()
        return str(event_id)

    windows: dict[int, Window] = {}
    relay_started = time.time()
    with (
        publishing(s, "postbox", relay_args=("--mode", "log", *relay_args), log_level="debug") as publishers,
        ReceiveTimes(s.kafka.bootstrap, topic, id_header) as consumer,
    ):
        relay = publishers[0]
        assert isinstance(relay, BenchRelay)
        received = consumer.received
        start = time.time()
        with Sampler(s.postgres.dsn, start, window, windows):
            committed, _ = paced_writes(s.postgres.dsn, rate, seconds, write_one)
            deadline = time.monotonic() + 60
            while len(received) < len(committed) and time.monotonic() < deadline:
                time.sleep(0.2)
        _, metrics = http_get(relay.metrics_port, "/metrics")
        relay.terminate()
        relay_log = relay.log()
    print(
        f"   (relay ready {start - relay_started:.1f} s after its start; clock below from the writers' start)"
    )
    shares = histogram_shares(metrics, "postbox_relay_commit_to_ack_seconds")
    _, slowest = latency_stages(s, relay_log, committed, received)
    print(
        f"   relay's commit_to_ack p99 {histogram_quantile(shares, 0.99) * 1000:.0f} ms (histogram); the "
        "slowest 1% of events, median per stage (ms): "
        + ", ".join(f"{stage} {slowest.get(stage, 0):.1f}" for stage in STAGES)
    )

    def at(when: float) -> Window:
        return windows.setdefault(int((when - start) // window), Window())

    for event_id, when in committed.items():
        if event_id in received:
            at(when).latencies.append((received[event_id] - when) * 1000)
    missing = len(committed) - sum(1 for e in committed if e in received)
    if missing:
        print(f"   {missing} events never received")
    claims: list[float] = []
    for line in relay_log.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        name = entry.get("event")
        if name == "relay_batch_published":
            w = at(entry["claim_started_at"])
            w.batches += 1
            w.claim_ms = max(w.claim_ms, (entry["claimed_at"] - entry["claim_started_at"]) * 1000)
            w.ack_ms = max(w.ack_ms, (entry["acked_at"] - entry["claimed_at"]) * 1000)
            w.mark_ms = max(w.mark_ms, (entry["committed_at"] - entry["acked_at"]) * 1000)
            claims.append(entry["claim_started_at"])
        elif name == "relay_lease_turn" and entry["began_at"] >= start - window:
            steps = {k: v for k, v in entry["ms"].items() if v >= 1}
            total = sum(entry["ms"].values())
            shown = json.dumps(steps, separators=(",", ":"))
            at(entry["began_at"]).lease_turns.append(
                f"{_clock(entry['began_at'], start)} {total:.0f} ms {shown}"
            )
        elif name in ("relay_partitions_maintained", "relay_census") and "timestamp" in entry:
            when = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            if when >= start - window:
                extra = {k: v for k, v in entry.items() if k not in ("event", "timestamp", "level", "logger")}
                at(when).notes.append(f"{_clock(when, start)} {name} {extra}")
    claims.sort()
    for before, after in itertools.pairwise(claims):
        w = at(after)
        w.gap_ms = max(w.gap_ms, (after - before) * 1000)
    return windows


def show(windows: dict[int, Window], window: float) -> None:
    print(
        f"   {'window':>9} {'n':>5} {'p50':>6} {'p99':>6} {'max':>6} | {'batch':>5} {'claim':>6} {'ack':>6} "
        f"{'mark':>6} {'gap':>6}   (ms; claim/ack/mark: the slowest batch's; gap: longest without a claim)"
    )
    everything: list[float] = []
    for index in sorted(windows):
        w = windows[index]
        if index < 0:
            continue
        values = sorted(w.latencies)
        everything.extend(values)
        label = f"{index * window:.0f}-{(index + 1) * window:.0f}s"
        figures = (
            f"{len(values):5} {percentile(values, 0.5):6.1f} {percentile(values, 0.99):6.1f} "
            f"{values[-1]:6.1f}"
            if values
            else f"{0:5} {'-':>6} {'-':>6} {'-':>6}"
        )
        print(
            f"   {label:>9} {figures} | {w.batches:5} {w.claim_ms:6.1f} {w.ack_ms:6.1f} {w.mark_ms:6.1f} "
            f"{w.gap_ms:6.1f}"
        )
        for turn in w.lease_turns:
            print(f"        lease turn {turn}")
        for note in w.notes:
            print(f"        {note}")
        for statement in w.statements:
            print(f"        pg {statement}")
        waits = ", ".join(f"{k} x{v}" for k, v in w.waits.most_common(5))
        if waits:
            print(f"        waits (100 ms samples): {waits}")
    everything.sort()
    if everything:
        print(
            f"   all: n={len(everything)} p50 {percentile(everything, 0.5):.1f} p99 "
            f"{percentile(everything, 0.99):.1f} p999 {percentile(everything, 0.999):.1f} "
            f"max {everything[-1]:.1f}"
        )


# Each phase: whether it keeps the schema (and tables) of the phase before, and the relay's extra arguments.
# warm-longlease: no lease turn (with its housekeeping: mode check, held refresh, gauges and census,
# partition upkeep) during the run but the first, every lane paused for each.
PHASES: dict[str, tuple[bool, tuple[str, ...]]] = {
    "fresh": (False, ()),
    "warm": (False, ()),
    "warm-keep": (True, ()),
    "warm-longlease": (False, ("--lease-ttl", "600")),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--phases", nargs="+", default=["fresh", "warm"], choices=tuple(PHASES))
    args = parser.parse_args()
    postgres = LocalPostgres(
        find_bin_dir(),
        settings={
            "wal_level": "logical",
            "max_connections": "300",
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "all",
        },
    ).start()
    kafka = LocalKafka(default_partitions=PARTITIONS).start()
    s = BenchServers(postgres, kafka)
    try:
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        for number, phase in enumerate(args.phases):
            print(
                f"\n-- phase {number + 1}: {phase} ({args.rate:.0f} events/s, {WRITERS} writers, "
                f"{args.seconds:.0f} s, "
                f"one relay with the defaults in log mode, debug log) --",
                flush=True,
            )
            keep, relay_args = PHASES[phase]
            windows = run_phase(s, args.rate, args.seconds, args.window, not keep, relay_args)
            show(windows, args.window)
    finally:
        kafka.stop()
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
