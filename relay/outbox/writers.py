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

One statement per call, whatever the number of rows. One row: a one-row VALUES. Several: the rows as one
array per column through unnest (WITH ORDINALITY keeps the list's order, so ids follow it), one statement
text for any number of rows, so drivers that prepare statements (psycopg after a few runs, asyncpg always)
prepare it once; psycopg sends the arrays in binary, which spares quoting every element in Python. The
sync SQLAlchemy, Django and psycopg2 paths, whose driver may be one that cannot bind arrays, send a
multi-row VALUES. Statements are built once per schema and kept (`tests/bench/writers.py` measures them).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal

# As the INSERT takes it: event_id, aggregate_type, aggregate_id, event_type, payload (JSON text),
# payload_bytes, headers (JSON text), topic.
Row = tuple[uuid.UUID, str, str, str, str | None, bytes | None, str, str | None]
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

# The kind found for each class of object seen (only kinds found: an unsupported class is looked up again
# each time, and raises anyway). A class's kind cannot change: the classes it was matched against exist
# once their module is imported, and a class's bases are fixed.
_KIND_OF_CLASS: dict[type, Kind] = {}


def kind_of(target: object) -> Kind | None:
    """Which driver API `target` speaks, or None when it is none postbox supports."""
    kind = _KIND_OF_CLASS.get(type(target))
    if kind is not None:
        return kind
    for module_name, class_names, kind in _CLASSES:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(target, tuple(getattr(module, name) for name in class_names)):
            _KIND_OF_CLASS[type(target)] = kind
            return kind
    return None


def check_target(target: object, *, want_async: bool) -> Kind:
    """The kind of `target`, or TypeError naming what is supported (nothing has been written)."""
    kind = kind_of(target)
    if kind is not None and (kind in SYNC_KINDS) != want_async:
        return kind
    name = f"{type(target).__module__}.{type(target).__qualname__}"
    if kind is None:
        raise TypeError(f"postbox cannot write through a {name}: pass {SUPPORTED}")
    if want_async:
        raise TypeError(f"{name} is synchronous: call enqueue / enqueue_many (not the _async ones) with it")
    raise TypeError(
        f"{name} is asynchronous: `await enqueue_async(...)` / `await enqueue_many_async(...)` with it "
        "(enqueue would return an event id and write nothing)"
    )


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


def unnest_statement(table: str, cell: Callable[[int, str], str]) -> str:
    """INSERT of the rows given as one array per column (`cell(n, cast)` as for values_statement, the cast
    an array's), in the arrays' order, whatever their length."""
    arrays = ", ".join(cell(col + 1, cast + "[]") for col, cast in enumerate(CASTS))
    return (
        f"INSERT INTO {table} ({', '.join(COLUMNS)}) SELECT a, b, c, d, e, f, g, h FROM unnest({arrays})"
        " WITH ORDINALITY AS u(a, b, c, d, e, f, g, h, n) ORDER BY n"
    )


def _plain(_n: int, _cast: str) -> str:  # psycopg 3, one row: the column's type is the parameter's
    return "%s"


def _binary(_n: int, cast: str) -> str:  # psycopg 3, arrays: sent in binary, cast to the column's type
    return f"%b::{cast}"


def _pyformat(_n: int, cast: str) -> str:  # psycopg2 and Django: positional %s
    return f"%s::{cast}"


def _numbered(n: int, cast: str) -> str:  # asyncpg: $n, encoded by asyncpg as the cast's type
    return f"${n}::{cast}"


def _named(n: int, cast: str) -> str:  # SQLAlchemy's text(): :name binds, whatever the driver below
    return f"CAST(:p{n} AS {cast})"


@lru_cache(maxsize=64)
def _psycopg_statements(schema: str) -> tuple[str, str]:
    """(one row, arrays) for psycopg 3. A '%' in the schema's name is doubled, as psycopg reads it."""
    table = quoted_table(schema).replace("%", "%%")
    return values_statement(table, 1, _plain), unnest_statement(table, _binary)


@lru_cache(maxsize=64)
def _asyncpg_statements(schema: str) -> tuple[str, str]:
    table = quoted_table(schema)
    return values_statement(table, 1, _numbered), unnest_statement(table, _numbered)


@lru_cache(maxsize=64)
def _sqlalchemy_statements(schema: str) -> tuple[Any, Any]:
    from sqlalchemy import text  # noqa: PLC0415  (only a caller holding a SQLAlchemy object gets here)

    # A ':' in the schema's name would read as a bind parameter: escaped, as text() documents.
    table = quoted_table(schema).replace(":", "\\:")
    return text(values_statement(table, 1, _named)), text(unnest_statement(table, _named))


@lru_cache(maxsize=256)
def _sqlalchemy_values(schema: str, rows: int) -> Any:
    from sqlalchemy import text  # noqa: PLC0415

    return text(values_statement(quoted_table(schema).replace(":", "\\:"), rows, _named))


@lru_cache(maxsize=256)
def _pyformat_values(schema: str, rows: int) -> str:
    # Django and psycopg2 (pyformat): a '%' in the schema's name is doubled, as pyformat reads it.
    return values_statement(quoted_table(schema).replace("%", "%%"), rows, _pyformat)


_BIND_NAMES = tuple(f"p{n}" for n in range(1, len(COLUMNS) + 1))


def _columns(rows: Sequence[Row]) -> list[list[Any]]:
    """One list per column, for the arrays."""
    return [list(column) for column in zip(*rows, strict=True)]


def _flat_text_ids(rows: Sequence[Row]) -> list[object]:
    """Every row's values in one list, the event id as text: psycopg2 cannot bind a UUID unless told to."""
    return [value for row in rows for value in (str(row[0]), *row[1:])]


def execute_sync(target: Any, kind: Kind, schema: str, rows: Sequence[Row]) -> None:
    """Insert `rows` (at least one) through a sync `target` of `kind`, in one statement."""
    if kind == "psycopg":
        one, many = _psycopg_statements(schema)
        if len(rows) == 1:
            target.execute(one, rows[0])
        else:
            target.execute(many, _columns(rows))
        return
    if kind == "sqlalchemy":
        values = _flat_text_ids(rows)
        binds = {f"p{index + 1}": value for index, value in enumerate(values)}
        target.execute(_sqlalchemy_values(schema, len(rows)), binds)
        return
    # Django and psycopg2: through a cursor, the connection's when given the connection.
    statement, params = _pyformat_values(schema, len(rows)), _flat_text_ids(rows)
    if hasattr(target, "fetchone"):  # a cursor: the caller's
        target.execute(statement, params)
        return
    cursor = target.cursor()  # ours, closed here (the transaction is the connection's)
    try:
        cursor.execute(statement, params)
    finally:
        cursor.close()


async def execute_async(target: Any, kind: Kind, schema: str, rows: Sequence[Row]) -> None:
    """Insert `rows` (at least one) through an async `target` of `kind`, in one statement."""
    if kind == "psycopg-async":
        one, many = _psycopg_statements(schema)
        if len(rows) == 1:
            await target.execute(one, rows[0])
        else:
            await target.execute(many, _columns(rows))
        return
    if kind == "sqlalchemy-async":
        # On asyncpg or psycopg, both of which bind a list as an array.
        one, many = _sqlalchemy_statements(schema)
        values = rows[0] if len(rows) == 1 else _columns(rows)
        await target.execute(one if len(rows) == 1 else many, dict(zip(_BIND_NAMES, values, strict=True)))
        return
    one, many = _asyncpg_statements(schema)
    if len(rows) == 1:
        await target.execute(one, *rows[0])
    else:
        await target.execute(many, *_columns(rows))
