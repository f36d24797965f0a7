"""What migration 0009's write guard costs a writer: the insert rate into an outbox with the guard and into
the same outbox without it (its two triggers dropped, as before 0009), side by side on one server.

    python -m tests.bench.write_guard [--rounds 7] [--single 2000] [--batches 100]

Needs a server: POSTBOX_DATABASE_URL (for example `eval "$(postbox dev env)"` after `postbox dev up`).
Each round times, for each outbox in turn (the order alternates), `--single` transactions of one
`enqueue` each, `--batches` transactions of one `enqueue_many` of 100 events, and one INSERT ... SELECT of
50,000 rows (the server's per-row cost without a commit per row). Prints each round's
rates, the medians with their spread, and the ratio guarded/unguarded per round and its median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import psycopg

from postbox.relay.core.migrate import migrate
from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_many
from postbox.relay.outbox.admin import switch_mode

Conn = psycopg.Connection[tuple[object, ...]]


def _prepare(url: str, schema: str, guarded: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn, schema)
        conn.execute(f'SET search_path TO "{schema}"')
        switch_mode(conn, schema, "log")  # the default for a new outbox
        if not guarded:
            conn.execute("DROP TRIGGER outbox_guard_insert ON outbox")
            conn.execute("DROP TRIGGER outbox_guard_update ON outbox")


def _single(conn: Conn, schema: str, count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        with conn.transaction():
            enqueue(conn, "bench", f"a{i % 64}", "Changed", {"i": i, "note": "x" * 100}, schema=schema)
    return count / (time.perf_counter() - started)


def _batches(conn: Conn, schema: str, count: int) -> float:
    started = time.perf_counter()
    for b in range(count):
        events = [OutboxEvent("bench", f"a{i % 64}", "Changed", {"i": i, "b": b}) for i in range(100)]
        with conn.transaction():
            enqueue_many(conn, events, schema=schema)
    return count * 100 / (time.perf_counter() - started)


BULK_ROWS = 50_000


def _bulk(conn: Conn, schema: str) -> float:
    """The server's per-row cost alone: one INSERT ... SELECT of BULK_ROWS rows (no commit per row)."""
    started = time.perf_counter()
    conn.execute(
        f'INSERT INTO "{schema}".outbox (aggregate_type, aggregate_id, event_type, payload) '
        "SELECT 'bench', 'a' || (i % 64), 'Changed', jsonb_build_object('i', i, 'note', repeat('x', 60)) "
        f"FROM generate_series(1, {BULK_ROWS}) AS i"
    )
    return BULK_ROWS / (time.perf_counter() - started)


def _summary(values: list[float]) -> str:
    return f"median {statistics.median(values):8.0f}/s (min {min(values):.0f}, max {max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--single", type=int, default=2000, help="one-event transactions per round")
    parser.add_argument("--batches", type=int, default=100, help="100-event transactions per round")
    args = parser.parse_args()
    url = os.environ["POSTBOX_DATABASE_URL"]
    tag = uuid.uuid4().hex[:6]
    schemas = {True: f"bench_guard_{tag}", False: f"bench_noguard_{tag}"}
    for guarded, schema in schemas.items():
        _prepare(url, schema, guarded)
    rates: dict[tuple[bool, str], list[float]] = {}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            server = conn.execute("SHOW server_version").fetchone()
            version = server[0] if server else "?"
            print(f"PostgreSQL {version}, {args.rounds} rounds, log mode, one connection")
            for round_no in range(args.rounds):
                order = [True, False] if round_no % 2 == 0 else [False, True]
                for guarded in order:
                    schema = schemas[guarded]
                    rates.setdefault((guarded, "single"), []).append(_single(conn, schema, args.single))
                    rates.setdefault((guarded, "batch"), []).append(_batches(conn, schema, args.batches))
                    conn.execute(f'TRUNCATE "{schema}".outbox')
                    rates.setdefault((guarded, "bulk"), []).append(_bulk(conn, schema))
                    conn.execute(f'TRUNCATE "{schema}".outbox')
                print(
                    f"round {round_no + 1}: single {rates[True, 'single'][-1]:.0f} vs "
                    f"{rates[False, 'single'][-1]:.0f}/s, batch {rates[True, 'batch'][-1]:.0f} vs "
                    f"{rates[False, 'batch'][-1]:.0f}/s (guarded vs unguarded)"
                )
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    for kind, label in (
        ("single", "one event per transaction"),
        ("batch", "100 events per transaction"),
        ("bulk", f"{BULK_ROWS:,} rows in one INSERT ... SELECT (no commit per row: the guard's cost alone)"),
    ):
        guarded, plain = rates[True, kind], rates[False, kind]
        ratios = [g / p for g, p in zip(guarded, plain, strict=True)]
        print(f"{label}:")
        print(f"  guarded   {_summary(guarded)}")
        print(f"  unguarded {_summary(plain)}")
        spread = f"min {min(ratios):.3f}, max {max(ratios):.3f}"
        print(f"  ratio     median {statistics.median(ratios):.3f} ({spread})")


if __name__ == "__main__":
    main()
