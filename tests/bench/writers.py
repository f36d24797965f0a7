"""What each way of writing an event costs, against a plain INSERT of the same row, on one server.

    python -m tests.bench.writers [--rounds 7] [--single 500] [--batches 30] [--blocks 10]

Needs a server: POSTBOX_DATABASE_URL (for example `eval "$(postbox dev env)"` after `postbox dev up`).

Each writer path is compared with a plain INSERT of the same rows in the same statement shape through the
same driver, so the ratio is what postbox adds (the checks, the encoding, the dispatch), not what a driver
or a statement shape costs:
- `enqueue` / `enqueue_many` on psycopg against "plain INSERT (psycopg)": for one event the same one-row
  INSERT, for 100 the same one statement of 100 rows (arrays through unnest, sent in binary);
- `enqueue_async` / `enqueue_many_async` on psycopg's AsyncConnection against the same statements on an
  AsyncConnection; on SQLAlchemy's AsyncSession over asyncpg against the same text() statements on an
  AsyncSession;
- the SQL `enqueue()`, one call per event, against the one-row INSERT (one event) and against 100
  one-row INSERT statements (100 events: one statement per event either way);
- the SQL `enqueue_many()`, one call per transaction, against the one-statement plain INSERT.
Every plain path encodes each event's payload with json.dumps and makes its event id with uuid4, as a
service writing the row by hand must; every row is the same 8 columns. One more row, "earlier baseline",
is the plain INSERT the first version of this benchmark compared with (a multi-row VALUES with the
constant columns inline and the payload encoded once per transaction), kept to read the old figures by.

Each round runs `--single` transactions of one event per path, then `--batches` transactions of 100
events, each split into `--blocks` blocks that run every path in turn (the order rotates per round), so
a slow spell of the shared machine falls on all paths alike. Every path keeps one connection throughout.
Prints each path's median rate with its spread, the median (and range) of its per-round ratio to its
plain INSERT, and the median ratio to the sync psycopg plain INSERT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import psycopg

from postbox.relay.core.migrate import migrate
from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_async, enqueue_many, enqueue_many_async

PAYLOAD = {"order": "o-1", "total": "12.30", "note": "x" * 100}
COLUMNS = "(event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic)"
Timer = Callable[[int, int], Awaitable[float]]  # (transactions, events per transaction) -> seconds
KINDS = (("single", "one event per transaction", 1), ("batch", "100 events per transaction", 100))


def _events(count: int) -> list[OutboxEvent]:
    return [OutboxEvent("bench", f"a{i % 64}", "Changed", PAYLOAD) for i in range(count)]


def _row(i: int) -> tuple[object, ...]:
    """One event's values as a service writing the row by hand has them."""
    return (uuid.uuid4(), "bench", f"a{i % 64}", "Changed", json.dumps(PAYLOAD), None, "{}", None)


def _columns(per: int) -> list[list[Any]]:
    return [list(column) for column in zip(*(_row(i) for i in range(per)), strict=True)]


def _psycopg_statements(schema: str) -> tuple[str, str]:
    """The statements enqueue and enqueue_many send through psycopg: one row, and the rows as arrays."""
    table = f'"{schema}".outbox'
    one = f"INSERT INTO {table} {COLUMNS} VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
    many = (
        f"INSERT INTO {table} {COLUMNS} SELECT a, b, c, d, e, f, g, h FROM unnest(%b::uuid[], %b::text[],"
        " %b::text[], %b::text[], %b::jsonb[], %b::bytea[], %b::jsonb[], %b::text[])"
        " WITH ORDINALITY AS u(a, b, c, d, e, f, g, h, n) ORDER BY n"
    )
    return one, many


@asynccontextmanager
async def _psycopg_path(
    url: str, write: Callable[[psycopg.Connection[Any], int], None]
) -> AsyncIterator[Timer]:
    """A path on one sync psycopg connection: `write(conn, per)` writes one transaction's events."""
    with psycopg.connect(url) as conn:

        async def run(transactions: int, per: int) -> float:
            started = time.perf_counter()
            for _ in range(transactions):
                write(conn, per)
                conn.commit()
            return time.perf_counter() - started

        yield run


def _plain(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    one, many = _psycopg_statements(schema)

    def write(conn: psycopg.Connection[Any], per: int) -> None:
        if per == 1:
            conn.execute(one, _row(0))
        else:
            conn.execute(many, _columns(per))

    return _psycopg_path(url, write)


def _plain_per_event(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    one, _ = _psycopg_statements(schema)

    def write(conn: psycopg.Connection[Any], per: int) -> None:
        for i in range(per):
            conn.execute(one, _row(i))

    return _psycopg_path(url, write)


def _earlier_baseline(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    row = "(%s::uuid, 'bench', %s, 'Changed', %s::jsonb, '{}'::jsonb)"
    columns = "(event_id, aggregate_type, aggregate_id, event_type, payload, headers)"

    def write(conn: psycopg.Connection[Any], per: int) -> None:
        statement = f'INSERT INTO "{schema}".outbox {columns} VALUES ' + ", ".join([row] * per)
        payload = json.dumps(PAYLOAD)
        params: list[object] = []
        for i in range(per):
            params += [str(uuid.uuid4()), f"a{i % 64}", payload]
        conn.execute(statement, params)

    return _psycopg_path(url, write)


def _sync_enqueue(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    def write(conn: psycopg.Connection[Any], per: int) -> None:
        if per == 1:
            enqueue(conn, "bench", "a1", "Changed", PAYLOAD, schema=schema)
        else:
            enqueue_many(conn, _events(per), schema=schema)

    return _psycopg_path(url, write)


def _sql_function(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    call = f"SELECT \"{schema}\".enqueue('bench', %s, 'Changed', %s)"

    def write(conn: psycopg.Connection[Any], per: int) -> None:
        for i in range(per):
            conn.execute(call, (f"a{i % 64}", json.dumps(PAYLOAD)))

    return _psycopg_path(url, write)


def _sql_function_many(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    call = f'SELECT "{schema}".enqueue_many(%b::text[], %b::text[], %b::text[], %b::jsonb[])'

    def write(conn: psycopg.Connection[Any], per: int) -> None:
        ids = [f"a{i % 64}" for i in range(per)]
        payloads = [json.dumps(PAYLOAD) for _ in range(per)]
        conn.execute(call, (["bench"] * per, ids, ["Changed"] * per, payloads))

    return _psycopg_path(url, write)


@asynccontextmanager
async def _async_psycopg_path(
    url: str, write: Callable[[psycopg.AsyncConnection[Any], int], Awaitable[None]]
) -> AsyncIterator[Timer]:
    async with await psycopg.AsyncConnection.connect(url) as conn:

        async def run(transactions: int, per: int) -> float:
            started = time.perf_counter()
            for _ in range(transactions):
                await write(conn, per)
                await conn.commit()
            return time.perf_counter() - started

        yield run


def _plain_async_psycopg(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    one, many = _psycopg_statements(schema)

    async def write(conn: psycopg.AsyncConnection[Any], per: int) -> None:
        if per == 1:
            await conn.execute(one, _row(0))
        else:
            await conn.execute(many, _columns(per))

    return _async_psycopg_path(url, write)


def _async_psycopg(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    async def write(conn: psycopg.AsyncConnection[Any], per: int) -> None:
        if per == 1:
            await enqueue_async(conn, "bench", "a1", "Changed", PAYLOAD, schema=schema)
        else:
            await enqueue_many_async(conn, _events(per), schema=schema)

    return _async_psycopg_path(url, write)


@asynccontextmanager
async def _session_path(url: str, write: Callable[[Any, int], Awaitable[None]]) -> AsyncIterator[Timer]:
    """A path on one SQLAlchemy AsyncSession over asyncpg, connected before any clock starts."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415

    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    try:
        async with AsyncSession(engine) as session:
            await session.connection()

            async def run(transactions: int, per: int) -> float:
                started = time.perf_counter()
                for _ in range(transactions):
                    await write(session, per)
                    await session.commit()
                return time.perf_counter() - started

            yield run
    finally:
        await engine.dispose()


def _plain_sqlalchemy_asyncpg(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    from sqlalchemy import text  # noqa: PLC0415

    table = f'"{schema}".outbox'
    casts = ("uuid", "text", "text", "text", "jsonb", "bytea", "jsonb", "text")
    names = [f"p{n}" for n in range(1, 9)]
    one = text(
        f"INSERT INTO {table} {COLUMNS} VALUES ("
        + ", ".join(f"CAST(:{name} AS {cast})" for name, cast in zip(names, casts, strict=True))
        + ")"
    )
    many = text(
        f"INSERT INTO {table} {COLUMNS} SELECT a, b, c, d, e, f, g, h FROM unnest("
        + ", ".join(f"CAST(:{name} AS {cast}[])" for name, cast in zip(names, casts, strict=True))
        + ") WITH ORDINALITY AS u(a, b, c, d, e, f, g, h, n) ORDER BY n"
    )

    async def write(session: Any, per: int) -> None:
        if per == 1:
            await session.execute(one, dict(zip(names, _row(0), strict=True)))
        else:
            await session.execute(many, dict(zip(names, _columns(per), strict=True)))

    return _session_path(url, write)


def _sqlalchemy_asyncpg(url: str, schema: str) -> AbstractAsyncContextManager[Timer]:
    async def write(session: Any, per: int) -> None:
        if per == 1:
            await enqueue_async(session, "bench", "a1", "Changed", PAYLOAD, schema=schema)
        else:
            await enqueue_many_async(session, _events(per), schema=schema)

    return _session_path(url, write)


PLAIN = "plain INSERT (psycopg)"
PLAIN_PER_EVENT = "plain INSERT, one statement per event"
# name: (timer, {kind: the plain path it is compared with}); a path without a kind's entry skips that kind.
PATHS: dict[str, tuple[Callable[[str, str], AbstractAsyncContextManager[Timer]], dict[str, str]]] = {
    PLAIN: (_plain, {"single": PLAIN, "batch": PLAIN}),
    PLAIN_PER_EVENT: (_plain_per_event, {"batch": PLAIN_PER_EVENT}),
    "earlier baseline (multi-row VALUES)": (_earlier_baseline, {"batch": PLAIN}),
    "enqueue (psycopg)": (_sync_enqueue, {"single": PLAIN, "batch": PLAIN}),
    "plain INSERT (psycopg async)": (
        _plain_async_psycopg,
        {"single": "plain INSERT (psycopg async)", "batch": "plain INSERT (psycopg async)"},
    ),
    "enqueue_async (psycopg)": (
        _async_psycopg,
        {"single": "plain INSERT (psycopg async)", "batch": "plain INSERT (psycopg async)"},
    ),
    "plain INSERT (SQLAlchemy, asyncpg)": (
        _plain_sqlalchemy_asyncpg,
        {"single": "plain INSERT (SQLAlchemy, asyncpg)", "batch": "plain INSERT (SQLAlchemy, asyncpg)"},
    ),
    "enqueue_async (SQLAlchemy, asyncpg)": (
        _sqlalchemy_asyncpg,
        {"single": "plain INSERT (SQLAlchemy, asyncpg)", "batch": "plain INSERT (SQLAlchemy, asyncpg)"},
    ),
    "SQL enqueue(), one call per event": (_sql_function, {"single": PLAIN, "batch": PLAIN_PER_EVENT}),
    "SQL enqueue_many(), one call": (_sql_function_many, {"single": PLAIN, "batch": PLAIN}),
}


async def _measure(url: str, schema: str, args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """{(path, kind): its rate in each round}. Every path keeps one connection for the whole run; a round
    runs `--blocks` blocks, each of every path in turn (the order rotates per round), so a slow spell of
    the machine falls on every path alike rather than on the one that ran then."""
    names = list(PATHS)
    rates: dict[tuple[str, str], list[float]] = {}
    async with AsyncExitStack() as stack:
        timers = {name: await stack.enter_async_context(PATHS[name][0](url, schema)) for name in names}
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for kind, _, per in KINDS:
                total = args.single if per == 1 else args.batches
                runs = [name for name in order if kind in PATHS[name][1]]
                elapsed = dict.fromkeys(runs, 0.0)
                for block in range(args.blocks):
                    transactions = total // args.blocks + (block < total % args.blocks)
                    for name in runs:
                        elapsed[name] += await timers[name](transactions, per)
                for name in runs:
                    rates.setdefault((name, kind), []).append(total * per / elapsed[name])
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f'TRUNCATE "{schema}".outbox')
            print(f"round {round_no + 1} done", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--single", type=int, default=500, help="one-event transactions per path and round")
    parser.add_argument("--batches", type=int, default=30, help="100-event transactions per path and round")
    parser.add_argument("--blocks", type=int, default=10, help="blocks each round's transactions run in")
    args = parser.parse_args()
    url = os.environ["POSTBOX_DATABASE_URL"]
    schema = f"bench_writers_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn, schema)
    try:
        rates = asyncio.run(_measure(url, schema, args))
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    print(
        f"{args.rounds} rounds of {args.blocks} blocks, one connection per path, "
        f"PostgreSQL at {url.rsplit('@', 1)[-1]}"
    )
    for kind, label, _ in KINDS:
        print(f"{label}: rate, then the ratio to the path's own plain INSERT (median, range), to {PLAIN}")
        for name in PATHS:
            if kind not in PATHS[name][1]:
                continue
            values = rates[name, kind]
            ratios = [v / b for v, b in zip(values, rates[PATHS[name][1][kind], kind], strict=True)]
            to_sync = [v / b for v, b in zip(values, rates[PLAIN, kind], strict=True)]
            print(
                f"  {name:38} median {statistics.median(values):7.0f}/s (min {min(values):.0f}, "
                f"max {max(values):.0f}); to its plain INSERT {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f}); to {PLAIN} {statistics.median(to_sync):.3f}"
            )


if __name__ == "__main__":
    main()
