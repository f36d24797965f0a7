"""Write outbox rows inside the caller's transaction (psycopg 3 connection or cursor)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg import sql

from relay.core.db import DEFAULT_SCHEMA
from relay.core.sql import name_for_parameters
from relay.core.tracing import current_trace_context, with_trace_context

JsonValue = Any  # anything json.dumps accepts
_NO_CONTEXT: Mapping[str, str] = MappingProxyType({})


class PayloadError(ValueError):
    """The event cannot be stored as given (not JSON-serialisable, bad headers); nothing was written."""


@dataclass(frozen=True)
class OutboxEvent:
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: JsonValue | bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    topic: str | None = None
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


# In JSON text a NUL is always written as the escape \u0000 (an escaped backslash before it does not count).
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _storable_text(name: str, text: str, is_json: bool = False) -> None:
    """PostgreSQL text and jsonb cannot hold NUL, nor (as UTF-8) a lone surrogate: say so before writing."""
    if "\x00" in text or (is_json and _JSON_NUL.search(text)):
        raise PayloadError(f"{name} contains NUL (U+0000), which PostgreSQL cannot store; send bytes instead")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{name} is not valid Unicode ({exc.reason} at {exc.start}); send bytes instead"
        ) from None


def _json(value: object) -> str:
    # ensure_ascii=False keeps NUL and lone surrogates as characters, where _storable_text finds them;
    # allow_nan=False: NaN and Infinity are not JSON and jsonb would refuse them.
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _row(event: OutboxEvent, trace_context: Mapping[str, str] = _NO_CONTEXT) -> tuple[object, ...]:
    for name in ("aggregate_type", "aggregate_id", "event_type"):
        value = getattr(event, name)
        if not isinstance(value, str) or not value:
            raise PayloadError(f"{name} must be a non-empty string, got {value!r}")
        _storable_text(name, value)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in event.headers.items()):
        raise PayloadError("headers must map str to str")
    if "" in event.headers:
        raise PayloadError("a header name is empty (Kafka clients drop such headers)")
    # The writer's trace context travels in the row, so the relay's publish span continues its trace.
    headers_json = _json(dict(with_trace_context(event.headers, trace_context)))
    _storable_text("headers", headers_json, is_json=True)
    if isinstance(event.payload, bytes | bytearray | memoryview):
        payload_json, payload_bytes = None, bytes(event.payload)
    else:
        try:
            payload_json, payload_bytes = _json(event.payload), None
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"payload of {event.event_type} is not JSON-serialisable: {exc}") from exc
        except RecursionError:  # found by the fuzzer: a deeply nested payload escaped as RecursionError
            raise PayloadError(f"payload of {event.event_type} is nested too deeply for JSON") from None
        _storable_text("payload", payload_json, is_json=True)
    return (
        event.event_id,
        event.aggregate_type,
        event.aggregate_id,
        event.event_type,
        payload_json,
        payload_bytes,
        headers_json,
        event.topic,
    )


_COLUMNS = "(event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic)"


def enqueue_many(
    conn_or_cursor: psycopg.Connection[Any] | psycopg.Cursor[Any],
    events: Iterable[OutboxEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
) -> list[uuid.UUID]:
    """Insert several events with one statement, in the given order; returns their event ids."""
    trace_context = current_trace_context()
    rows = [_row(e, trace_context) for e in events]  # validate everything before writing anything
    if not rows:
        return []
    columns = list(zip(*rows, strict=True))
    # WITH ORDINALITY keeps the caller's order, so ids (publish order) follow the list.
    statement = sql.SQL(
        "INSERT INTO {} " + _COLUMNS + " SELECT a, b, c, d, e, f, g, h FROM unnest("
        "%s::uuid[], %s::text[], %s::text[], %s::text[], %s::jsonb[], %s::bytea[], %s::jsonb[], %s::text[])"
        " WITH ORDINALITY AS u(a, b, c, d, e, f, g, h, n) ORDER BY n"
    ).format(name_for_parameters(schema, "outbox"))
    conn_or_cursor.execute(statement, [list(c) for c in columns])
    return [row[0] for row in rows]  # type: ignore[misc]


def enqueue(
    conn_or_cursor: psycopg.Connection[Any] | psycopg.Cursor[Any],
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    payload: JsonValue | bytes,
    headers: Mapping[str, str] | None = None,
    topic: str | None = None,
    *,
    event_id: uuid.UUID | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> uuid.UUID:
    """Insert one event in the caller's open transaction; returns its event id (the Kafka `id` header)."""
    event = OutboxEvent(
        aggregate_type, aggregate_id, event_type, payload, headers or {}, topic, event_id or uuid.uuid4()
    )
    statement = sql.SQL("INSERT INTO {} " + _COLUMNS + " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)").format(
        name_for_parameters(schema, "outbox")
    )
    conn_or_cursor.execute(statement, _row(event, current_trace_context()))
    return event.event_id
