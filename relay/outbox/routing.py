"""From an outbox row to a Kafka message: topic, key, value and headers. Pure, no I/O.

The default is byte-compatible with the Debezium outbox event router's defaults, so a consumer written for
Debezium works unchanged: topic `outbox.event.<aggregate_type>`, key = aggregate id, header `id` = event
id, value = the payload. The row's own headers (for example W3C `traceparent`) travel as Kafka headers.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
ID_HEADER = "id"
# The only placeholders a topic template may hold, written exactly so: no format spec, conversion, index
# or attribute (each of those would hand a row's value to a formatter).
_PLACEHOLDER = re.compile(r"\{(aggregate_type|event_type)\}")
_SHOWN_CHARS = 80  # at most this much of an operator's or a writer's text is quoted in a message


class RoutingError(ValueError):
    """The row cannot become a Kafka message; the row is parked with this reason."""


# NamedTuples, not frozen dataclasses: the relay builds one of each per event, and a frozen dataclass's
# __init__ (object.__setattr__ per field) cost about 1 us a row more on the drain's hot path.
class OutboxRow(NamedTuple):
    id: int
    event_id: str  # the uuid's text form
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: str | None  # JSON text, as stored
    payload_bytes: bytes | None
    headers: dict[str, object] | None  # None when there are none
    topic: str | None
    shard: int
    created_epoch: float = 0.0  # the writing transaction's start (created_at), for latency metrics
    size: int = 0  # the message's bytes (payload, key, headers, type): message_bytes, stored at write time


class Message(NamedTuple):
    topic: str
    key: bytes
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]


# Kafka's own rule for a topic name (kafka.common.internals.Topic): 1-249 of these characters, not "."
# or "..". Names beginning "__" are the cluster's internal topics (__consumer_offsets,
# __transaction_state, ...), which no outbox row may write to.
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_topic_name(topic: str) -> str:
    """`topic`, or RoutingError saying why Kafka would never accept it (the row is parked: no broker
    setting can make such a name usable, so holding the row back would wedge it forever)."""
    if not _LEGAL_TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise RoutingError(
            f"topic {_shown(topic)!r} is not a legal Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)"
        )
    if topic.startswith("__"):
        raise RoutingError(f"topic {_shown(topic)!r} is reserved for Kafka's internal topics")
    return topic


class TopicTemplate:
    """An operator's topic template, parsed once at start: literal text and the placeholders
    {aggregate_type} and {event_type}. A topic is built by joining the literal parts and the row's fields,
    never with str.format, so no value a writer stores ever reaches a formatter (a template that could
    make one do so is refused here, before anything is claimed)."""

    __slots__ = ("fields", "literals", "text")

    def __init__(self, text: str) -> None:
        parts = _PLACEHOLDER.split(text)
        self.text = text
        self.literals: tuple[str, ...] = tuple(parts[0::2])  # one more than fields: around each field
        self.fields: tuple[str, ...] = tuple(parts[1::2])
        _check_template(self)

    def render(self, row: OutboxRow) -> str:
        """The topic for a row (RoutingError when it leaves a field the template uses empty); the name is
        checked by the caller."""
        if not self.fields:
            return self.text
        built = [self.literals[0]]
        for field, literal in zip(self.fields, self.literals[1:], strict=True):
            value = row.aggregate_type if field == "aggregate_type" else row.event_type
            if not value:
                shown = _shown(self.text)
                raise RoutingError(f"{field} is empty, and the topic template {shown!r} routes by it")
            built.append(value)
            built.append(literal)
        return "".join(built)


def _check_template(template: TopicTemplate) -> None:
    text = template.text
    shown = _shown(text)
    if not text:
        raise ValueError("the topic template is empty; it may use only {aggregate_type} and {event_type}")
    for literal in template.literals:
        brace = re.search(r"\{[^{}]*\}?|\}", literal)
        if brace is not None:
            raise ValueError(
                f"topic template {shown!r}: {_shown(brace.group())!r} is no placeholder; it may use only "
                "{aggregate_type} and {event_type}, written exactly so (no format spec, conversion, index "
                "or attribute)"
            )
        illegal = re.search(r"[^A-Za-z0-9._-]", literal)
        if illegal is not None:
            raise ValueError(
                f"topic template {shown!r}: {illegal.group()!r} can be in no Kafka topic name "
                "(1-249 of A-Z a-z 0-9 . _ -), so no row routed by it could be published"
            )
    if sum(map(len, template.literals)) > 249:
        raise ValueError(f"topic template {shown!r}: longer than a Kafka topic name can be (249 characters)")
    if template.literals[0].startswith("__"):
        raise ValueError(f"topic template {shown!r}: topics beginning '__' are Kafka's internal topics")
    if not template.fields:
        try:
            check_topic_name(text)
        except RoutingError as exc:
            raise ValueError(f"topic template {shown!r}: {exc}") from None


def validate_topic_template(template: str) -> str:
    """The template, or ValueError saying what in it is not allowed (see TopicTemplate)."""
    TopicTemplate(template)
    return template


def _shown(text: str) -> str:
    """Text for a message: at most _SHOWN_CHARS characters of it."""
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def topic_for(row: OutboxRow, template: str | TopicTemplate) -> str:
    """The row's topic: its own `topic` column when set, else the template. RoutingError when that is
    no legal topic name, or when the template needs a field the row leaves empty."""
    if row.topic:  # NULL or '' (as before): routed by the template
        return check_topic_name(row.topic)
    parsed = template if isinstance(template, TopicTemplate) else TopicTemplate(template)
    return check_topic_name(parsed.render(row))


class TopicRoutes:
    """topic_for with the template fixed, remembered per (topic, aggregate_type, event_type): a batch
    mostly repeats a few of them, and formatting and checking the name again for every row cost about
    1 us a row. Holds at most `limit` answers (then starts over), whatever a writer puts in the rows, and
    only for fields of at most `key_chars` characters together: a writer's fields can be up to a message's
    size each, and 4,096 remembered megabyte-long types would outgrow the relay's memory limit."""

    def __init__(self, template: str | TopicTemplate, limit: int = 4096, key_chars: int = 1024) -> None:
        self._template = template if isinstance(template, TopicTemplate) else TopicTemplate(template)
        self._limit = limit
        self._key_chars = key_chars
        self._known: dict[tuple[str | None, str, str], str | RoutingError] = {}

    def topic(self, row: OutboxRow) -> str:
        """topic_for(row, template): the topic, or RoutingError."""
        key = (row.topic, row.aggregate_type, row.event_type)
        if len(row.topic or "") + len(row.aggregate_type) + len(row.event_type) > self._key_chars:
            return topic_for(row, self._template)  # too long to keep (and no legal topic is this long)
        known = self._known.get(key)
        if known is None:
            try:
                known = topic_for(row, self._template)
            except RoutingError as exc:
                known = exc
            if len(self._known) >= self._limit:
                self._known.clear()
            self._known[key] = known
        if isinstance(known, RoutingError):
            raise RoutingError(*known.args)
        return known


def to_message(row: OutboxRow, topic: str, type_header: str | None = None) -> Message:
    """The Kafka message for a row, to `topic` (from `topic_for`, which the relay has already called to
    check the topic). `type_header`, when set, also carries the event type (the usual Debezium option
    `table.fields.additional.placement=type:header:eventType`)."""
    headers: list[tuple[str, str | bytes | None]] = [(ID_HEADER, row.event_id.encode())]
    if type_header:
        headers.append((type_header, row.event_type.encode()))
    if row.headers:  # most rows have none (None): no loop set up for them
        for name, value in row.headers.items():
            if not name:  # before the next test: with no type header configured, type_header is "" too
                raise RoutingError("a header name is empty (Kafka clients drop such headers)")
            if name in (ID_HEADER, type_header):
                continue  # the event id is authoritative; a user header must not forge it
            if not isinstance(value, str):
                raise RoutingError(f"header {_shown(name)!r} is not a string")
            headers.append((name, value.encode()))
    if row.payload_bytes is not None:
        value_bytes: bytes | None = row.payload_bytes
    elif row.payload is not None:
        value_bytes = row.payload.encode()
    else:
        value_bytes = None  # a tombstone, as Debezium emits for a NULL payload
    return Message(topic, row.aggregate_id.encode(), value_bytes, headers)


def load_headers(text: str) -> dict[str, object]:
    """A row's headers from their JSON text, as stored. The relay loads them here, in the row's guarded
    preparation, rather than when the batch is fetched: jsonb holds values Python cannot load (an integer
    past 4,300 digits, arrays nested past the recursion limit), and a fetch that raised failed the batch."""
    headers = json.loads(text)
    if not isinstance(headers, dict):  # outbox_headers_object: only if that constraint was dropped
        raise RoutingError("headers are not a JSON object")
    return headers


# The relay package's directory as this module was imported (not resolved: in a checkout postbox/relay is a
# symbolic link, and the frames' file names carry the path they were imported by).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def raised_in(exc: BaseException) -> str:
    """Where in postbox `exc` was raised: the innermost of its frames in the relay package, as
    `function (file:line)`; names code only, never a value."""
    where = "?"
    trace = exc.__traceback__
    while trace is not None:
        code = trace.tb_frame.f_code
        if code.co_filename.startswith(_PACKAGE):
            where = f"{code.co_name} ({Path(code.co_filename).name}:{trace.tb_lineno})"
        trace = trace.tb_next
    return where


def unpreparable_reason(exc: BaseException) -> str:
    """Why a row whose preparation raised `exc` is parked. A RoutingError says it in words written never
    to quote a payload; anything else by its class and where postbox met it, never str(exc), which may
    quote the row's contents (a value, a format spec, a JSON fragment)."""
    if isinstance(exc, RoutingError):
        return str(exc)
    return f"the row could not be made into a message: {type(exc).__name__} in {raised_in(exc).split(' ')[0]}"
