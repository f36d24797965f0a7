"""Every way a service writes an event, on the real PostgreSQL: commit writes exactly one row with the
columns given, rollback none, and an object postbox does not support (or a sync one given to the async
API, and the reverse) raises TypeError with nothing written."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from postbox import OutboxEvent, enqueue, enqueue_async, enqueue_many, enqueue_many_async
from tests.servers import Servers

Conn = psycopg.Connection[tuple[object, ...]]


def _rows(db: Conn, aggregate_type: str) -> list[tuple[object, ...]]:
    return db.execute(
        "SELECT event_id::text, aggregate_id, event_type, payload, payload_bytes, headers, topic FROM outbox "
        "WHERE aggregate_type = %s ORDER BY id",
        (aggregate_type,),
    ).fetchall()


def _expected(event_id: uuid.UUID, n: int = 1) -> tuple[object, ...]:
    return (str(event_id), f"a-{n}", "Placed", {"n": n, "note": "50% off: $1 ':x'"}, None, {"k": "v"}, None)


def _payload(n: int = 1) -> dict[str, object]:
    return {"n": n, "note": "50% off: $1 ':x'"}  # placeholders of every driver, as plain text


def _sqlalchemy_url(servers: Servers, driver: str) -> str:
    return servers.database_url.replace("postgresql://", f"postgresql+{driver}://", 1)


SYNC_WRITERS = ["psycopg-connection", "psycopg-cursor", "sqlalchemy-connection", "sqlalchemy-session",
                "psycopg2-connection", "psycopg2-cursor"]  # fmt: skip


@pytest.mark.parametrize("writer", SYNC_WRITERS)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_sync_writer_writes_in_the_callers_transaction(
    servers: Servers, schema: str, db: Conn, writer: str, outcome: str
) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    written: list[uuid.UUID] = []

    def write(target: Any) -> None:
        written.append(
            enqueue(target, aggregate_type, "a-1", "Placed", _payload(), {"k": "v"}, schema=schema)
        )
        written.extend(
            enqueue_many(
                target, [OutboxEvent(aggregate_type, "a-2", "Placed", _payload(2), {"k": "v"})], schema=schema
            )
        )

    if writer.startswith("psycopg-"):
        with psycopg.connect(servers.database_url) as conn:
            write(conn if writer == "psycopg-connection" else conn.cursor())
            getattr(conn, outcome)()
    elif writer.startswith("psycopg2-"):
        import psycopg2  # noqa: PLC0415

        conn2 = psycopg2.connect(servers.database_url)
        try:
            write(conn2 if writer == "psycopg2-connection" else conn2.cursor())
            getattr(conn2, outcome)()
        finally:
            conn2.close()
    else:
        from sqlalchemy import create_engine  # noqa: PLC0415
        from sqlalchemy.orm import Session  # noqa: PLC0415

        engine = create_engine(_sqlalchemy_url(servers, "psycopg"))
        try:
            if writer == "sqlalchemy-connection":
                with engine.connect() as sa_conn:
                    write(sa_conn)
                    getattr(sa_conn, outcome)()
            else:
                with Session(engine) as session:
                    write(session)
                    getattr(session, outcome)()
        finally:
            engine.dispose()
    rows = _rows(db, aggregate_type)
    if outcome == "rollback":
        assert rows == []
    else:
        assert rows == [_expected(written[0], 1), _expected(written[1], 2)]


ASYNC_WRITERS = ["psycopg-async-connection", "psycopg-async-cursor", "sqlalchemy-async-connection",
                 "sqlalchemy-async-session", "sqlalchemy-asyncpg-session", "asyncpg-connection"]  # fmt: skip


async def _with_async_writer(
    servers: Servers, writer: str, outcome: str, write: Callable[[Any], Awaitable[None]]
) -> None:
    if writer.startswith("psycopg-async"):
        async with await psycopg.AsyncConnection.connect(servers.database_url) as conn:
            await write(conn if writer == "psycopg-async-connection" else conn.cursor())
            await getattr(conn, outcome)()
    elif writer == "asyncpg-connection":
        import asyncpg  # noqa: PLC0415

        conn = await asyncpg.connect(servers.database_url)
        try:
            transaction = conn.transaction()
            await transaction.start()
            await write(conn)
            await getattr(transaction, outcome)()
        finally:
            await conn.close()
    else:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: PLC0415

        driver = "asyncpg" if "asyncpg" in writer else "psycopg"
        engine = create_async_engine(_sqlalchemy_url(servers, driver))
        try:
            if writer == "sqlalchemy-async-connection":
                async with engine.connect() as sa_conn:
                    await write(sa_conn)
                    await getattr(sa_conn, outcome)()
            else:
                async with AsyncSession(engine) as session:
                    await write(session)
                    await getattr(session, outcome)()
        finally:
            await engine.dispose()


@pytest.mark.parametrize("writer", ASYNC_WRITERS)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_an_async_writer_writes_in_the_callers_transaction(
    servers: Servers, schema: str, db: Conn, writer: str, outcome: str
) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    written: list[uuid.UUID] = []

    async def write(target: Any) -> None:
        written.append(
            await enqueue_async(
                target, aggregate_type, "a-1", "Placed", _payload(), {"k": "v"}, schema=schema
            )
        )
        event = OutboxEvent(aggregate_type, "a-2", "Placed", _payload(2), {"k": "v"})
        written.extend(await enqueue_many_async(target, [event], schema=schema))

    asyncio.run(_with_async_writer(servers, writer, outcome, write))
    rows = _rows(db, aggregate_type)
    if outcome == "rollback":
        assert rows == []
    else:
        assert rows == [_expected(written[0], 1), _expected(written[1], 2)]


def test_a_django_cursor_and_connection_write_in_an_atomic_block(
    servers: Servers, schema: str, db: Conn
) -> None:
    import django  # noqa: PLC0415
    from django.conf import settings  # noqa: PLC0415
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    if not settings.configured:
        parts = conninfo_to_dict(servers.database_url)
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": parts.get("dbname", "postgres"),
                    "USER": parts.get("user", "postgres"),
                    "HOST": parts.get("host", "127.0.0.1"),
                    "PORT": parts.get("port", "5432"),
                }
            }
        )
        django.setup()
    from django.db import connection, transaction  # noqa: PLC0415

    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        first = enqueue(connection, aggregate_type, "a-1", "Placed", _payload(), {"k": "v"}, schema=schema)
        with connection.cursor() as cursor:
            [second] = enqueue_many(
                cursor, [OutboxEvent(aggregate_type, "a-2", "Placed", _payload(2), {"k": "v"})], schema=schema
            )
    try:
        with transaction.atomic():
            enqueue(connection, aggregate_type, "a-3", "Placed", _payload(3), schema=schema)
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    connection.close()
    assert _rows(db, aggregate_type) == [_expected(first, 1), _expected(second, 2)]


class _NotAConnection:
    def execute(self, *_: object) -> None:
        raise AssertionError("never called")


def test_an_unsupported_object_or_the_wrong_kind_is_refused_before_anything_is_written(
    servers: Servers, schema: str, db: Conn
) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    with pytest.raises(TypeError, match=r"postbox cannot write through a .*_NotAConnection: pass a psycopg"):
        enqueue(_NotAConnection(), aggregate_type, "a", "E", {})

    async def async_misuse() -> None:
        async with await psycopg.AsyncConnection.connect(servers.database_url, autocommit=True) as aconn:
            with pytest.raises(TypeError, match="is asynchronous: `await enqueue_async"):
                enqueue(aconn, aggregate_type, "a", "E", {}, schema=schema)
            with pytest.raises(TypeError, match="is asynchronous"):
                enqueue_many(aconn, [OutboxEvent(aggregate_type, "a", "E", {})], schema=schema)
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            with pytest.raises(TypeError, match="is synchronous: call enqueue"):
                await enqueue_async(conn, aggregate_type, "a", "E", {}, schema=schema)
            with pytest.raises(TypeError, match="is synchronous"):
                await enqueue_many_async(conn, [OutboxEvent(aggregate_type, "a", "E", {})], schema=schema)

    asyncio.run(async_misuse())
    assert _rows(db, aggregate_type) == [], "nothing written, even on autocommit connections"


def test_the_sql_functions_write_with_the_same_checks(servers: Servers, schema: str, db: Conn) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    found = db.execute(
        "SELECT enqueue(%s, 'a-1', 'Placed', %s::jsonb, '{\"k\": \"v\"}')",
        (aggregate_type, json.dumps(_payload())),
    ).fetchone()
    assert found is not None
    as_bytes = db.execute(
        "SELECT enqueue_bytes(%s, 'a-2', 'Placed', '\\x0102'::bytea)", (aggregate_type,)
    ).fetchone()
    assert as_bytes is not None
    rows = _rows(db, aggregate_type)
    assert rows[0] == _expected(found[0], 1)
    assert rows[1][4] == b"\x01\x02"
    for call, message in [
        ("SELECT enqueue('', 'a', 'E', '{}')", "aggregate_type must be a non-empty text"),
        ("SELECT enqueue('t', 'a', 'E', '{}', '[]')", "headers must be a JSON object"),
        ("SELECT enqueue('t', 'a', 'E', '{}', '{\"k\": 1}')", "headers must map non-empty names to strings"),
    ]:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            db.execute(call)
