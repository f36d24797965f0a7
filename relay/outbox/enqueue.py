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

from postbox.relay.core.db import DEFAULT_SCHEMA
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
    """One event for enqueue_many (and enqueue_many_async): the arguments enqueue takes, as a value.

    Attributes:
        aggregate_type: what the event is about (`order`); names the topic by default.
        aggregate_id: which one; the Kafka key, and the unit of order.
        event_type: what happened (`OrderChanged`); sent in a header.
        payload: a JSON value (encoded by one documented rule per type), bytes (sent as they are), or
            None (a tombstone: a null value on Kafka).
        headers: extra Kafka headers, text.
        topic: a topic of its own, instead of the routed one.
        event_id: the message id, stable across duplicates; a new UUID by default.
    """

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
    # The substring tests first: the regex (an escaped backslash before it does not count) runs only for
    # the rare text that holds one, and ASCII text (most of it) holds no surrogate, so is not encoded.
    if "\x00" in text or (is_json and "\\u0000" in text and _JSON_NUL.search(text)):
        raise PayloadError(f"{name} contains NUL (U+0000), which PostgreSQL cannot store; send bytes instead")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{name} is not valid Unicode ({exc.reason} at {exc.start}); send bytes instead"
        ) from None


def _check_names(aggregate_type: object, aggregate_id: str, event_type: object, topic: object) -> None:
    """aggregate_type, aggregate_id and event_type non-empty text, topic text or None, all storable."""
    # The usual event (exact str, ASCII, no NUL) is checked in one pass over the three joined; anything
    # else goes through the checks one by one, which say which value is wrong.
    if (
        type(aggregate_type) is str
        and type(event_type) is str
        and aggregate_type
        and aggregate_id
        and event_type
        and (topic is None or type(topic) is str)
    ):
        joined = aggregate_type + aggregate_id + event_type + (topic or "")
        if joined.isascii() and "\x00" not in joined:
            return
    for name, value in (("aggregate_type", aggregate_type), ("aggregate_id", aggregate_id),
                        ("event_type", event_type)):  # fmt: skip
        if not isinstance(value, str) or not value:
            raise PayloadError(f"{name} must be a non-empty string, got {value!r}")
        _storable_text(name, value)
    if topic is not None:
        if not isinstance(topic, str):
            raise PayloadError(f"topic must be a str or None, got {type(topic).__name__}")
        _storable_text("topic", topic)


def _headers_json(headers: Mapping[str, str], trace_context: Mapping[str, str]) -> str:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise PayloadError("headers must map str to str")
    if "" in headers:
        raise PayloadError("a header name is empty (Kafka clients drop such headers)")
    # The writer's trace context travels in the row, so the relay's publish span continues its trace.
    merged = with_trace_context(headers, trace_context)
    if not merged:
        return "{}"
    text = encode_json(dict(merged))
    _storable_text("headers", text, is_json=True)
    return text


def _payload_json(event_type: str, payload: JsonValue, json_default: JsonDefault | None) -> str:
    try:
        text = encode_json(payload, json_default)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"payload of {event_type} is not JSON-serialisable: {exc}") from exc
    except RecursionError:  # found by the fuzzer: a deeply nested payload escaped as RecursionError
        raise PayloadError(f"payload of {event_type} is nested too deeply for JSON") from None
    _storable_text("payload", text, is_json=True)
    return text


def _event_id(value: object) -> uuid.UUID:
    """The event id as a UUID (text in a UUID's form is taken too; anything else is refused before the
    database would refuse it halfway through the caller's transaction)."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise PayloadError(f"event_id must be a UUID, got {value!r}") from None


def _row_of(
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str],
    topic: str | None,
    event_id: object,
    trace_context: Mapping[str, str],
    json_default: JsonDefault | None,
) -> Row:
    """The row of one event, every check made (PayloadError, naming what is wrong, before any write)."""
    key = aggregate_id if type(aggregate_id) is str else aggregate_key(aggregate_id)
    _check_names(aggregate_type, key, event_type, topic)
    headers_json = _headers_json(headers, trace_context) if headers or trace_context else "{}"
    if isinstance(payload, bytes | bytearray | memoryview):
        payload_json, payload_bytes = None, bytes(payload)
    elif payload is None:  # a tombstone: both columns NULL, and the relay sends a null value
        payload_json, payload_bytes = None, None
    else:
        payload_json, payload_bytes = _payload_json(event_type, payload, json_default), None
    return (_event_id(event_id), aggregate_type, key, event_type, payload_json, payload_bytes, headers_json,
            topic)  # fmt: skip


def _row(
    event: OutboxEvent,
    trace_context: Mapping[str, str] = _NO_CONTEXT,
    json_default: JsonDefault | None = None,
) -> Row:
    return _row_of(
        event.aggregate_type,
        event.aggregate_id,
        event.event_type,
        event.payload,
        event.headers,
        event.topic,
        event.event_id,
        trace_context,
        json_default,
    )


def _rows(events: Iterable[OutboxEvent], json_default: JsonDefault | None) -> list[Row]:
    """Every event validated and encoded before anything is written."""
    trace_context = current_trace_context()
    return [_row(e, trace_context, json_default) for e in events]


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
        execute_sync(conn_or_cursor, kind, schema, rows)
    return [row[0] for row in rows]


def _one_row(
    aggregate_type: str,
    aggregate_id: str | int | uuid.UUID,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str] | None,
    topic: str | None,
    event_id: uuid.UUID | None,
    json_default: JsonDefault | None,
) -> Row:
    """The row of one event, as enqueue and enqueue_async write it (checked; the trace context added)."""
    return _row_of(
        aggregate_type,
        aggregate_id,
        event_type,
        payload,
        headers or _NO_CONTEXT,
        topic,
        event_id or uuid.uuid4(),
        current_trace_context(),
        json_default,
    )


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
    row = _one_row(aggregate_type, aggregate_id, event_type, payload, headers, topic, event_id, json_default)
    execute_sync(conn_or_cursor, kind, schema, [row])
    return row[0]


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
        await execute_async(conn, kind, schema, rows)
    return [row[0] for row in rows]


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
    kind = check_target(conn, want_async=True)
    row = _one_row(aggregate_type, aggregate_id, event_type, payload, headers, topic, event_id, json_default)
    await execute_async(conn, kind, schema, [row])
    return row[0]
