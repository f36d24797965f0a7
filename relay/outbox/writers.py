"""The INSERT of outbox rows, in the caller's own transaction, through whatever the caller holds.

Supported (sync: `enqueue`, `enqueue_many`; async: `enqueue_async`, `enqueue_many_async`):
- psycopg 3: Connection, Cursor (sync); AsyncConnection, AsyncCursor (async);
- SQLAlchemy 2.x: Connection, Session (sync); AsyncConnection, AsyncSession (async), on any PostgreSQL
  driver (psycopg, asyncpg, psycopg2): the statement goes through SQLAlchemy, in its transaction;
- asyncpg: Connection, and a pool's connection (async);
- Django: `django.db.connection` and its cursors, on the psycopg 3 and psycopg2 backends (sync);
- psycopg2: connection, cursor (sync).
Anything else, or a sync object given to the async API and the reverse, is refused with TypeError before
a statement is sent: an async connection given to a sync call would return a coroutine nobody awaits, and
the event would be lost while its id was returned.

An object is recognised by the classes of the libraries already imported (sys.modules): an object of a
library that is not imported cannot be one of its classes, and postbox imports none of them itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

Row = tuple[str, str, str, str, str | None, bytes | None, str, str | None]  # as the INSERT takes it
Kind = Literal["psycopg", "dbapi", "sqlalchemy", "psycopg-async", "sqlalchemy-async", "asyncpg"]
SYNC_KINDS = ("psycopg", "dbapi", "sqlalchemy")

SUPPORTED = (
    "a psycopg Connection or Cursor, a SQLAlchemy Connection or Session, a Django connection or cursor, or "
    "a psycopg2 connection or cursor (enqueue, enqueue_many); a psycopg AsyncConnection or AsyncCursor, a "
    "SQLAlchemy AsyncConnection or AsyncSession, or an asyncpg Connection (enqueue_async, "
    "enqueue_many_async)"
)
COLUMNS = (
    "event_id", "aggregate_type", "aggregate_id", "event_type", "payload", "payload_bytes", "headers", "topic"
)  # fmt: skip
CASTS = ("uuid", "text", "text", "text", "jsonb", "bytea", "jsonb", "text")


# (module, classes, kind), looked up only in modules already imported; the first match decides. Django's
# psycopg 3 backend hands out psycopg cursors, which the first line takes.
_CLASSES: tuple[tuple[str, tuple[str, ...], Kind], ...] = (
    ("psycopg", ("Connection", "Cursor"), "psycopg"),
    ("psycopg", ("AsyncConnection", "AsyncCursor"), "psycopg-async"),
    ("sqlalchemy.ext.asyncio", ("AsyncConnection", "AsyncSession"), "sqlalchemy-async"),
    ("sqlalchemy.engine", ("Connection",), "sqlalchemy"),
    ("sqlalchemy.orm", ("Session",), "sqlalchemy"),
    ("asyncpg", ("Connection",), "asyncpg"),  # a pool's connection proxy passes this check too
    ("django.db.backends.utils", ("CursorWrapper",), "dbapi"),
    ("django.db.backends.base.base", ("BaseDatabaseWrapper",), "dbapi"),
    ("django.utils.connection", ("ConnectionProxy",), "dbapi"),  # django.db.connection
    ("psycopg2.extensions", ("connection", "cursor"), "dbapi"),
)


def kind_of(target: object) -> Kind | None:
    """Which driver API `target` speaks, or None when it is none postbox supports."""
    for module_name, class_names, kind in _CLASSES:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(target, tuple(getattr(module, name) for name in class_names)):
            return kind
    return None


def check_target(target: object, *, want_async: bool) -> Kind:
    """The kind of `target`, or TypeError naming what is supported (nothing has been written)."""
    kind = kind_of(target)
    name = f"{type(target).__module__}.{type(target).__qualname__}"
    if kind is None:
        raise TypeError(f"postbox cannot write through a {name}: pass {SUPPORTED}")
    if want_async and kind in SYNC_KINDS:
        raise TypeError(f"{name} is synchronous: call enqueue / enqueue_many (not the _async ones) with it")
    if not want_async and kind not in SYNC_KINDS:
        raise TypeError(
            f"{name} is asynchronous: `await enqueue_async(...)` / `await enqueue_many_async(...)` with it "
            "(enqueue would return an event id and write nothing)"
        )
    return kind


def quoted_table(schema: str) -> str:
    """The outbox's name in `schema`, quoted as SQL needs whatever the schema's name holds."""
    return '"' + schema.replace('"', '""') + '"."outbox"'


def values_statement(table: str, rows: int, cell: Callable[[int, str], str]) -> str:
    """INSERT of `rows` rows in one multi-row VALUES (ids follow the list's order). `cell(n, cast)` writes
    the n-th parameter (from 1) cast to its column's type, in the driver's placeholder style."""
    width = len(COLUMNS)
    groups = (
        "(" + ", ".join(cell(row * width + col + 1, cast) for col, cast in enumerate(CASTS)) + ")"
        for row in range(rows)
    )
    return f"INSERT INTO {table} ({', '.join(COLUMNS)}) VALUES " + ", ".join(groups)


def _pyformat(_n: int, cast: str) -> str:  # psycopg2 and Django: positional %s
    return f"%s::{cast}"


def _numbered(n: int, cast: str) -> str:  # asyncpg: $n, every value sent as text (bytes as bytea)
    return f"${n}::bytea" if cast == "bytea" else f"${n}::text::{cast}"


def _named(n: int, cast: str) -> str:  # SQLAlchemy's text(): :name binds, whatever the driver below
    return f"CAST(:p{n} AS {cast})"


def _flat(rows: Sequence[Row]) -> list[object]:
    return [value for row in rows for value in row]


def _sqlalchemy_statement(schema: str, rows: Sequence[Row]) -> tuple[Any, dict[str, object]]:
    from sqlalchemy import text  # noqa: PLC0415  (only a caller holding a SQLAlchemy object gets here)

    # A ':' in the schema's name would read as a bind parameter: escaped, as text() documents.
    table = quoted_table(schema).replace(":", "\\:")
    binds = {f"p{index + 1}": value for index, value in enumerate(_flat(rows))}
    return text(values_statement(table, len(rows), _named)), binds


def execute_sync(target: Any, kind: Kind, schema: str, rows: Sequence[Row]) -> None:
    """Insert `rows` through a sync `target` of `kind` (not "psycopg": enqueue keeps its own statements)."""
    if kind == "sqlalchemy":
        statement, binds = _sqlalchemy_statement(schema, rows)
        target.execute(statement, binds)
        return
    # Django and psycopg2 (pyformat): through a cursor, the connection's when given the connection. A '%'
    # in the schema's name is doubled, as pyformat reads it.
    table = quoted_table(schema).replace("%", "%%")
    statement, params = values_statement(table, len(rows), _pyformat), _flat(rows)
    if hasattr(target, "fetchone"):  # a cursor: the caller's
        target.execute(statement, params)
        return
    cursor = target.cursor()  # ours, closed here (the transaction is the connection's)
    try:
        cursor.execute(statement, params)
    finally:
        cursor.close()


async def execute_async(target: Any, kind: Kind, schema: str, rows: Sequence[Row]) -> None:
    """Insert `rows` through an async `target` of `kind` (not "psycopg-async")."""
    if kind == "sqlalchemy-async":
        statement, binds = _sqlalchemy_statement(schema, rows)
        await target.execute(statement, binds)
        return
    await target.execute(values_statement(quoted_table(schema), len(rows), _numbered), *_flat(rows))
