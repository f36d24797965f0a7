"""What each way of writing an event costs, against a plain INSERT of the same row, on one server.

    python -m tests.bench.writers [--rounds 5] [--single 500] [--batches 30]

Needs a server: POSTBOX_DATABASE_URL (for example `eval "$(postbox dev env)"` after `postbox dev up`).
Paths: a plain psycopg INSERT (the baseline), `enqueue` on psycopg, `enqueue_async` on psycopg's
AsyncConnection, `enqueue_async` on SQLAlchemy's AsyncSession over asyncpg, and the SQL function
`enqueue()` called through psycopg. Each round runs every path in turn (the order rotates): `--single`
transactions of one event, then `--batches` transactions of 100 events. Prints each path's median rate
with its spread and the median of its per-round ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import psycopg

from postbox.relay.core.migrate import migrate
from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_async, enqueue_many, enqueue_many_async

PAYLOAD = {"order": "o-1", "total": "12.30", "note": "x" * 100}
COLUMNS = "(event_id, aggregate_type, aggregate_id, event_type, payload, headers)"
Timer = Callable[[int, int], Awaitable[float]]  # (transactions, events per transaction) -> events/s


def _events(count: int) -> list[OutboxEvent]:
    return [OutboxEvent("bench", f"a{i % 64}", "Changed", PAYLOAD) for i in range(count)]


def _plain(url: str, schema: str) -> Timer:
    """The baseline: the same row, by a plain parameterised INSERT (multi-row VALUES for a batch)."""

    async def run(transactions: int, per: int) -> float:
        with psycopg.connect(url) as conn:
            one = "(%s::uuid, 'bench', %s, 'Changed', %s::jsonb, '{}'::jsonb)"
            statement = f'INSERT INTO "{schema}".outbox {COLUMNS} VALUES ' + ", ".join([one] * per)
            payload = json.dumps(PAYLOAD)
            started = time.perf_counter()
            for _ in range(transactions):
                params: list[object] = []
                for i in range(per):
                    params += [str(uuid.uuid4()), f"a{i % 64}", payload]
                conn.execute(statement, params)
                conn.commit()
            return transactions * per / (time.perf_counter() - started)

    return run


def _sync_enqueue(url: str, schema: str) -> Timer:
    async def run(transactions: int, per: int) -> float:
        with psycopg.connect(url) as conn:
            started = time.perf_counter()
            for _ in range(transactions):
                if per == 1:
                    enqueue(conn, "bench", "a1", "Changed", PAYLOAD, schema=schema)
                else:
                    enqueue_many(conn, _events(per), schema=schema)
                conn.commit()
            return transactions * per / (time.perf_counter() - started)

    return run


def _async_psycopg(url: str, schema: str) -> Timer:
    async def run(transactions: int, per: int) -> float:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            started = time.perf_counter()
            for _ in range(transactions):
                if per == 1:
                    await enqueue_async(conn, "bench", "a1", "Changed", PAYLOAD, schema=schema)
                else:
                    await enqueue_many_async(conn, _events(per), schema=schema)
                await conn.commit()
            return transactions * per / (time.perf_counter() - started)

    return run


def _sqlalchemy_asyncpg(url: str, schema: str) -> Timer:
    async def run(transactions: int, per: int) -> float:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415

        engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
        try:
            async with AsyncSession(engine) as session:
                await session.connection()  # connected before the clock starts, as the others are
                started = time.perf_counter()
                for _ in range(transactions):
                    if per == 1:
                        await enqueue_async(session, "bench", "a1", "Changed", PAYLOAD, schema=schema)
                    else:
                        await enqueue_many_async(session, _events(per), schema=schema)
                    await session.commit()
                return transactions * per / (time.perf_counter() - started)
        finally:
            await engine.dispose()

    return run


def _sql_function(url: str, schema: str) -> Timer:
    async def run(transactions: int, per: int) -> float:
        with psycopg.connect(url) as conn:
            call = f"SELECT \"{schema}\".enqueue('bench', %s, 'Changed', %s::jsonb)"
            payload = json.dumps(PAYLOAD)
            started = time.perf_counter()
            for _ in range(transactions):
                for i in range(per):
                    conn.execute(call, (f"a{i % 64}", payload))
                conn.commit()
            return transactions * per / (time.perf_counter() - started)

    return run


PATHS: dict[str, Callable[[str, str], Timer]] = {
    "plain INSERT": _plain,
    "enqueue (psycopg)": _sync_enqueue,
    "enqueue_async (psycopg)": _async_psycopg,
    "enqueue_async (SQLAlchemy, asyncpg)": _sqlalchemy_asyncpg,
    "SQL enqueue() per event": _sql_function,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--single", type=int, default=500, help="one-event transactions per path and round")
    parser.add_argument("--batches", type=int, default=30, help="100-event transactions per path and round")
    args = parser.parse_args()
    url = os.environ["POSTBOX_DATABASE_URL"]
    schema = f"bench_writers_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn, schema)
    names = list(PATHS)
    timers = {name: PATHS[name](url, schema) for name in names}
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                for kind, transactions, per in (("single", args.single, 1), ("batch", args.batches, 100)):
                    rate = asyncio.run(timers[name](transactions, per))
                    rates.setdefault((name, kind), []).append(rate)
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f'TRUNCATE "{schema}".outbox')
            print(f"round {round_no + 1} done")
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    print(f"{args.rounds} rounds, one connection per path, PostgreSQL at {url.rsplit('@', 1)[-1]}")
    for kind, label in (("single", "one event per transaction"), ("batch", "100 events per transaction")):
        print(f"{label}:")
        base = rates["plain INSERT", kind]
        for name in names:
            values = rates[name, kind]
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            print(
                f"  {name:38} median {statistics.median(values):8.0f}/s (min {min(values):.0f}, "
                f"max {max(values):.0f}); to the plain INSERT {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )


if __name__ == "__main__":
    main()
