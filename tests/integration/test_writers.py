"""Every way a service writes an event, on the real PostgreSQL: commit writes exactly one row with the
columns given, rollback none, and an object postbox does not support (or a sync one given to the async
API, and the reverse) raises TypeError with nothing written."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from postbox import OutboxEvent, PayloadError, enqueue, enqueue_async, enqueue_many, enqueue_many_async
from postbox.relay.core.db import connect
from tests.support.database import prepare_outbox
from tests.support.servers import Servers

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


def _with_sync_writer(servers: Servers, writer: str, outcome: str, write: Callable[[Any], None]) -> None:
    if writer == "psycopg-client-cursor":  # client-side binding: every parameter a literal in the text
        with psycopg.connect(servers.database_url, cursor_factory=psycopg.ClientCursor) as conn:
            write(conn)
            getattr(conn, outcome)()
    elif writer.startswith("psycopg-"):
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

        engine = create_engine(_sqlalchemy_url(servers, "psycopg2" if "psycopg2" in writer else "psycopg"))
        try:
            if writer.endswith("-connection"):
                with engine.connect() as sa_conn:
                    write(sa_conn)
                    getattr(sa_conn, outcome)()
            else:
                with Session(engine) as session:
                    write(session)
                    getattr(session, outcome)()
        finally:
            engine.dispose()


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

    _with_sync_writer(servers, writer, outcome, write)
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


@pytest.fixture
def odd_schema(servers: Servers) -> Iterator[str]:
    """A migrated schema whose name holds every kind of placeholder a driver reads: %s, %b, :name, $1."""
    name = f'Odd "w" 50%s %b :p1 $1 {uuid.uuid4().hex[:6]}'
    prepare_outbox(servers.database_url, name)
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def _batch(aggregate_type: str) -> list[OutboxEvent]:
    """Every kind of value a row holds: JSON and bytes payloads, headers or none, a topic or none, ids that
    are not text, non-ASCII text."""
    return [
        OutboxEvent(aggregate_type, 7, "Placed", {"note": "50% off: $1 ':x' %b é"}, {"k": "v"}),
        OutboxEvent(aggregate_type, "a-2", "Sent", b"\x00\xff", topic="custom.topic"),
        OutboxEvent(aggregate_type, uuid.UUID(int=3), "Placed", [1, "ü", None]),
        OutboxEvent(aggregate_type, "a-4", "Placed", None, {"h": "ü"}, "other.topic"),
    ]


def _expected_batch(ids: list[uuid.UUID], aggregate_type: str) -> list[tuple[object, ...]]:
    return [
        (str(ids[0]), "7", "Placed", {"note": "50% off: $1 ':x' %b é"}, None, {"k": "v"}, None),
        (str(ids[1]), "a-2", "Sent", None, b"\x00\xff", {}, "custom.topic"),
        (str(ids[2]), str(uuid.UUID(int=3)), "Placed", [1, "ü", None], None, {}, None),
        (str(ids[3]), "a-4", "Placed", None, None, {"h": "ü"}, "other.topic"),
    ]


@pytest.mark.parametrize(
    "writer", [*SYNC_WRITERS, "psycopg-client-cursor", "sqlalchemy-psycopg2-connection", *ASYNC_WRITERS]
)
def test_every_writer_writes_a_batch_in_list_order_and_a_single_bytes_event(
    servers: Servers, odd_schema: str, writer: str
) -> None:
    """Several events go as one statement (arrays, or a multi-row VALUES for the sync SQLAlchemy, Django and
    psycopg2 paths), one event as a one-row INSERT: both through every writer, into a schema whose name
    holds placeholders, with every kind of value."""
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    written: list[uuid.UUID] = []
    single = {"aggregate_type": aggregate_type, "aggregate_id": "a-5", "event_type": "Sent",
              "payload": b"\x01", "topic": "t.5", "schema": odd_schema}  # fmt: skip

    if writer in ASYNC_WRITERS:

        async def write_async(target: Any) -> None:
            written.extend(await enqueue_many_async(target, _batch(aggregate_type), schema=odd_schema))
            written.append(await enqueue_async(target, **single))

        asyncio.run(_with_async_writer(servers, writer, "commit", write_async))
    else:

        def write(target: Any) -> None:
            written.extend(enqueue_many(target, _batch(aggregate_type), schema=odd_schema))
            written.append(enqueue(target, **single))

        _with_sync_writer(servers, writer, "commit", write)
    with connect(servers.database_url, odd_schema, autocommit=True) as conn:
        rows = _rows(conn, aggregate_type)
        tombstones = conn.execute(
            "SELECT event_id FROM outbox "
            "WHERE aggregate_type = %s AND payload IS NULL AND payload_bytes IS NULL",
            (aggregate_type,),
        ).fetchall()
    assert rows == [
        *_expected_batch(written, aggregate_type),
        (str(written[4]), "a-5", "Sent", None, b"\x01", {}, "t.5"),
    ]
    # A None payload is a tombstone (both columns NULL, so the relay sends a null value), not JSON null.
    assert tombstones == [(written[3],)]
    assert all(type(event_id) is uuid.UUID for event_id in written)


def test_an_event_id_given_as_text_is_stored_and_returned_as_a_uuid(
    servers: Servers, schema: str, db: Conn
) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    given = uuid.uuid4()
    with psycopg.connect(servers.database_url) as conn:
        returned = enqueue(conn, aggregate_type, "a", "E", {}, event_id=str(given), schema=schema)  # type: ignore[arg-type]
        with pytest.raises(PayloadError, match="event_id must be a UUID"):
            enqueue(conn, aggregate_type, "a", "E", {}, event_id="not-a-uuid", schema=schema)  # type: ignore[arg-type]
        conn.commit()
    assert returned == given
    assert [row[0] for row in _rows(db, aggregate_type)] == [str(given)]


def _sql_many(db: Conn, *arrays: object) -> list[uuid.UUID]:
    placeholders = ", ".join(["%s"] * len(arrays))
    found = db.execute(f"SELECT enqueue_many({placeholders})", arrays).fetchone()
    assert found is not None
    return found[0]  # type: ignore[no-any-return]


def test_the_sql_enqueue_many_writes_every_event_in_order_in_one_call(db: Conn) -> None:
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    payloads = [Jsonb(_payload(1)), None, Jsonb([1, "ü"])]
    ids = _sql_many(
        db, [aggregate_type] * 3, ["a-1", "a-2", "a-3"], ["Placed", "Deleted", "Placed"], payloads
    )
    assert len(ids) == 3
    assert _rows(db, aggregate_type) == [
        (str(ids[0]), "a-1", "Placed", _payload(1), None, {}, None),
        (str(ids[1]), "a-2", "Deleted", None, None, {}, None),  # a NULL element: a tombstone
        (str(ids[2]), "a-3", "Placed", [1, "ü"], None, {}, None),
    ]
    other = f"w{uuid.uuid4().hex[:8]}"
    headers = [Jsonb({"k": "v"}), Jsonb({})]
    more = _sql_many(
        db, [other] * 2, ["b-1", "b-2"], ["E", "E"], [Jsonb({}), Jsonb({})], headers, ["t.1", None]
    )
    assert _rows(db, other) == [
        (str(more[0]), "b-1", "E", {}, None, {"k": "v"}, "t.1"),
        (str(more[1]), "b-2", "E", {}, None, {}, None),
    ]
    assert _sql_many(db, [], [], [], []) == []


# What enqueue() refuses, as (aggregate_type, aggregate_id, event_type, headers): enqueue_many() refuses the
# same, naming the event, and writes none of the events given with it.
REFUSED = [
    ("", "a", "E", {}),
    (None, "a", "E", {}),
    ("t", "", "E", {}),
    ("t", None, "E", {}),
    ("t", "a", "", {}),
    ("t", "a", None, {}),
    ("t", "a", "E", None),
    ("t", "a", "E", []),
    ("t", "a", "E", "text"),
    ("t", "a", "E", {"k": 1}),
    ("t", "a", "E", {"k": None}),
    ("t", "a", "E", {"k": {"nested": "x"}}),
    ("t", "a", "E", {"": "x"}),
    ("t", "a", "E", {"ok": "v", "": "x"}),
]


@pytest.mark.parametrize(("aggregate_type", "aggregate_id", "event_type", "headers"), REFUSED)
def test_the_sql_enqueue_many_refuses_what_enqueue_refuses_and_writes_nothing(
    db: Conn, aggregate_type: str | None, aggregate_id: str | None, event_type: str | None, headers: object
) -> None:
    marker = f"w{uuid.uuid4().hex[:8]}"
    as_json = None if headers is None else Jsonb(headers)
    with pytest.raises(psycopg.errors.InvalidParameterValue) as one:
        db.execute(
            "SELECT enqueue(%s, %s, %s, '{}', %s)", (aggregate_type, aggregate_id, event_type, as_json)
        )
    problem = str(one.value).splitlines()[0].removeprefix("enqueue: ")
    arrays = (  # the bad event second, between two good ones
        [marker, aggregate_type, marker],
        ["a", aggregate_id, "a"],
        ["E", event_type, "E"],
        [Jsonb({})] * 3,
        [Jsonb({}), as_json, Jsonb({})],
    )
    with pytest.raises(psycopg.errors.InvalidParameterValue) as many:
        _sql_many(db, *arrays)
    assert str(many.value).splitlines()[0] == f"enqueue_many: event 2 of 3: {problem}"
    assert db.execute("SELECT count(*) FROM outbox WHERE aggregate_type = %s", (marker,)).fetchone() == (0,)


def test_the_sql_enqueue_many_refuses_arrays_that_do_not_line_up(db: Conn) -> None:
    for arrays, message in [
        ((["t", "t"], ["a"], ["E", "E"], [Jsonb({})] * 2), "one element per event"),
        ((["t"], ["a"], ["E"], [Jsonb({})], [Jsonb({})] * 2), "one element per event"),
        ((["t"], ["a"], ["E"], [Jsonb({})], None, ["x", "y"]), "one element per event"),
        ((None, ["a"], ["E"], [Jsonb({})]), "must be arrays, not NULL"),
        ((["t"], ["a"], ["E"], None), "must be arrays, not NULL"),
        (([["t"], ["u"]], ["a", "b"], ["E", "E"], [Jsonb({})] * 2), "one-dimensional"),
    ]:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            _sql_many(db, *arrays)


def test_the_sql_writers_write_to_their_own_schemas_outbox_whatever_the_search_path(
    servers: Servers, schema: str, db: Conn
) -> None:
    """enqueue() and enqueue_bytes() carry no search_path setting since migration 0011 (so PostgreSQL can
    inline them): their bodies are bound when created, and the function they call keeps its own."""
    aggregate_type = f"w{uuid.uuid4().hex[:8]}"
    with psycopg.connect(servers.database_url, autocommit=True) as other:
        other.execute(
            "CREATE TEMP TABLE outbox (LIKE pg_catalog.pg_class)"
        )  # an `outbox` the path finds first
        other.execute("SET search_path TO pg_temp, public")
        table = sql.Identifier(schema)
        other.execute(sql.SQL("SELECT {}.enqueue(%s, 'a-1', 'E', '{{}}')").format(table), (aggregate_type,))
        other.execute(
            sql.SQL("SELECT {}.enqueue_bytes(%s, 'a-2', 'E', '\\x01')").format(table), (aggregate_type,)
        )
        other.execute(
            sql.SQL(
                "SELECT {}.enqueue_many(ARRAY[%s], ARRAY['a-3'], ARRAY['E'], ARRAY['{{}}']::jsonb[])"
            ).format(table),
            (aggregate_type,),
        )
    assert [row[1] for row in _rows(db, aggregate_type)] == ["a-1", "a-2", "a-3"]
