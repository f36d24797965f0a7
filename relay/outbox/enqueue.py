"""Write outbox rows inside the caller's transaction, through whatever connection the caller holds.

`enqueue` and `enqueue_many` take a sync connection or cursor (psycopg 3, SQLAlchemy, Django, psycopg2);
`enqueue_async` and `enqueue_many_async` an async one (psycopg 3, SQLAlchemy, asyncpg), and are awaited.
relay.outbox.writers says which objects, and refuses any other with TypeError before anything is
written; relay.outbox.payload says how typed values are encoded.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from psycopg import sql

from postbox.relay.core.db import DEFAULT_SCHEMA
from postbox.relay.core.sql import name_for_parameters
from postbox.relay.core.tracing import current_trace_context, with_trace_context
from postbox.relay.outbox.payload import JsonDefault, PayloadError, aggregate_key, encode_json
from postbox.relay.outbox.writers import Row, check_target, execute_async, execute_sync

__all__ = [
    "OutboxEvent",
    "PayloadError",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]

JsonValue = Any  # anything relay.outbox.payload.encode_json takes
_NO_CONTEXT: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class OutboxEvent:
    aggregate_type: str
    aggregate_id: str | int | uuid.UUID  # stored as text (relay.outbox.payload.aggregate_key)
    event_type: str
    payload: JsonValue | bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    topic: str | None = None
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


# In JSON text a NUL is always written as the escape \u0000 (an escaped backslash before it does not count).
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _storable_text(name: str, text: str, is_json: bool = False) -> None:
    """PostgreSQL text and jsonb cannot hold NUL, nor (as UTF-8) a lone surrogate: say so before writing."""
    # The substring test first: the regex (an escaped backslash before it does not count) runs only for
    # the rare text that holds one, which spared an event about 3 us.
    if "\x00" in text or (is_json and "\\u0000" in text and _JSON_NUL.search(text)):
        raise PayloadError(f"{name} contains NUL (U+0000), which PostgreSQL cannot store; send bytes instead")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{name} is not valid Unicode ({exc.reason} at {exc.start}); send bytes instead"
        ) from None


def _row(
    event: OutboxEvent,
    trace_context: Mapping[str, str] = _NO_CONTEXT,
    json_default: JsonDefault | None = None,
) -> Row:
    aggregate_id = aggregate_key(event.aggregate_id)
    for name, value in (
        ("aggregate_type", event.aggregate_type),
        ("aggregate_id", aggregate_id),
        ("event_type", event.event_type),
    ):
        if not isinstance(value, str) or not value:
            raise PayloadError(f"{name} must be a non-empty string, got {value!r}")
        _storable_text(name, value)
    if event.topic is not None:
        if not isinstance(event.topic, str):
            raise PayloadError(f"topic must be a str or None, got {type(event.topic).__name__}")
        _storable_text("topic", event.topic)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in event.headers.items()):
        raise PayloadError("headers must map str to str")
    if "" in event.headers:
        raise PayloadError("a header name is empty (Kafka clients drop such headers)")
    # The writer's trace context travels in the row, so the relay's publish span continues its trace.
    headers = with_trace_context(event.headers, trace_context)
    if headers:
        headers_json = encode_json(dict(headers))
        _storable_text("headers", headers_json, is_json=True)
    else:
        headers_json = "{}"
    if isinstance(event.payload, bytes | bytearray | memoryview):
        payload_json, payload_bytes = None, bytes(event.payload)
    else:
        try:
            payload_json, payload_bytes = encode_json(event.payload, json_default), None
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"payload of {event.event_type} is not JSON-serialisable: {exc}") from exc
        except RecursionError:  # found by the fuzzer: a deeply nested payload escaped as RecursionError
            raise PayloadError(f"payload of {event.event_type} is nested too deeply for JSON") from None
        _storable_text("payload", payload_json, is_json=True)
    return (
        str(event.event_id),
        event.aggregate_type,
        aggregate_id,
        event.event_type,
        payload_json,
        payload_bytes,
        headers_json,
        event.topic,
    )


def _rows(events: Iterable[OutboxEvent], json_default: JsonDefault | None) -> list[Row]:
    """Every event validated and encoded before anything is written."""
    trace_context = current_trace_context()
    return [_row(e, trace_context, json_default) for e in events]


def _event(
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str] | None,
    topic: str | None,
    event_id: uuid.UUID | None,
) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type, aggregate_id, event_type, payload, headers or {}, topic, event_id or uuid.uuid4()
    )


_COLUMNS = "(event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic)"


def _psycopg_many(schema: str, rows: list[Row]) -> tuple[sql.Composed, list[list[object]]]:
    """psycopg 3's statement for several rows: the rows as arrays, one parameter per column however many
    rows; WITH ORDINALITY keeps the caller's order, so ids (publish order) follow the list."""
    statement = sql.SQL(
        "INSERT INTO {} " + _COLUMNS + " SELECT a, b, c, d, e, f, g, h FROM unnest("
        "%s::uuid[], %s::text[], %s::text[], %s::text[], %s::jsonb[], %s::bytea[], %s::jsonb[], %s::text[])"
        " WITH ORDINALITY AS u(a, b, c, d, e, f, g, h, n) ORDER BY n"
    ).format(name_for_parameters(schema, "outbox"))
    return statement, [list(c) for c in zip(*rows, strict=True)]


def enqueue_many(
    conn_or_cursor: Any,
    events: Iterable[OutboxEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
    json_default: JsonDefault | None = None,
) -> list[uuid.UUID]:
    """Insert several events with one statement, in the given order, in the caller's open transaction;
    returns their event ids. `conn_or_cursor`: see relay.outbox.writers (TypeError for anything else)."""
    kind = check_target(conn_or_cursor, want_async=False)
    rows = _rows(events, json_default)
    if rows:
        if kind == "psycopg":
            conn_or_cursor.execute(*_psycopg_many(schema, rows))
        else:
            execute_sync(conn_or_cursor, kind, schema, rows)
    return [uuid.UUID(row[0]) for row in rows]


def enqueue(
    conn_or_cursor: Any,
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str] | None = None,
    topic: str | None = None,
    *,
    event_id: uuid.UUID | None = None,
    schema: str = DEFAULT_SCHEMA,
    json_default: JsonDefault | None = None,
) -> uuid.UUID:
    """Insert one event in the caller's open transaction; returns its event id (the Kafka `id` header)."""
    kind = check_target(conn_or_cursor, want_async=False)
    event = _event(aggregate_type, aggregate_id, event_type, payload, headers, topic, event_id)
    [row] = _rows([event], json_default)
    if kind == "psycopg":
        statement = sql.SQL("INSERT INTO {} " + _COLUMNS + " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)").format(
            name_for_parameters(schema, "outbox")
        )
        conn_or_cursor.execute(statement, row)
    else:
        execute_sync(conn_or_cursor, kind, schema, [row])
    return event.event_id


async def enqueue_many_async(
    conn: Any,
    events: Iterable[OutboxEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
    json_default: JsonDefault | None = None,
) -> list[uuid.UUID]:
    """enqueue_many for an async connection (psycopg AsyncConnection or AsyncCursor, SQLAlchemy
    AsyncConnection or AsyncSession, asyncpg Connection); awaited."""
    kind = check_target(conn, want_async=True)
    rows = _rows(events, json_default)
    if rows:
        if kind == "psycopg-async":
            await conn.execute(*_psycopg_many(schema, rows))
        else:
            await execute_async(conn, kind, schema, rows)
    return [uuid.UUID(row[0]) for row in rows]


async def enqueue_async(
    conn: Any,
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str] | None = None,
    topic: str | None = None,
    *,
    event_id: uuid.UUID | None = None,
    schema: str = DEFAULT_SCHEMA,
    json_default: JsonDefault | None = None,
) -> uuid.UUID:
    """enqueue for an async connection; awaited. Same arguments, same checks, same row."""
    event = _event(aggregate_type, aggregate_id, event_type, payload, headers, topic, event_id)
    [event_id] = await enqueue_many_async(conn, [event], schema=schema, json_default=json_default)
    return event_id
