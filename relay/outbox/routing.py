"""From an outbox row to a Kafka message: topic, key, value and headers. Pure, no I/O.

The default is byte-compatible with the Debezium outbox event router's defaults, so a consumer written for
Debezium works unchanged: topic `outbox.event.<aggregate_type>`, key = aggregate id, header `id` = event
id, value = the payload. The row's own headers (for example W3C `traceparent`) travel as Kafka headers.
"""

from __future__ import annotations

import re
import string
from typing import NamedTuple

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
_TEMPLATE_FIELDS = {"aggregate_type", "event_type"}
ID_HEADER = "id"


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


def validate_topic_template(template: str) -> str:
    """The template, or ValueError naming the fields it may use."""
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    unknown = fields - _TEMPLATE_FIELDS
    if unknown or not template:
        raise ValueError(f"topic template {template!r} may use only {{aggregate_type}} and {{event_type}}")
    return template


# Kafka's own rule for a topic name (kafka.common.internals.Topic): 1-249 of these characters, not "."
# or "..". Names beginning "__" are the cluster's internal topics (__consumer_offsets,
# __transaction_state, ...), which no outbox row may write to.
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_topic_name(topic: str) -> str:
    """`topic`, or RoutingError saying why Kafka would never accept it (the row is parked: no broker
    setting can make such a name usable, so holding the row back would wedge it forever)."""
    if not _LEGAL_TOPIC.fullmatch(topic) or topic in (".", ".."):
        shown = topic if len(topic) <= 80 else topic[:80] + "..."
        raise RoutingError(f"topic {shown!r} is not a legal Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)")
    if topic.startswith("__"):
        raise RoutingError(f"topic {topic!r} is reserved for Kafka's internal topics")
    return topic


def topic_for(row: OutboxRow, template: str) -> str:
    """The row's topic: its own `topic` column when set, else the template. RoutingError when that is
    no legal topic name, or when the template needs a field the row leaves empty."""
    if row.topic:  # NULL or '' (as before): routed by the template
        return check_topic_name(row.topic)
    for name in ("aggregate_type", "event_type"):
        if f"{{{name}}}" in template and not getattr(row, name):
            raise RoutingError(f"{name} is empty, and the topic template {template!r} routes by it")
    return check_topic_name(template.format(aggregate_type=row.aggregate_type, event_type=row.event_type))


class TopicRoutes:
    """topic_for with the template fixed, remembered per (topic, aggregate_type, event_type): a batch
    mostly repeats a few of them, and formatting and checking the name again for every row cost about
    1 us a row. Holds at most `limit` answers (then starts over), whatever a writer puts in the rows, and
    only for fields of at most `key_chars` characters together: a writer's fields can be up to a message's
    size each, and 4,096 remembered megabyte-long types would outgrow the relay's memory limit."""

    def __init__(self, template: str, limit: int = 4096, key_chars: int = 1024) -> None:
        self._template = template
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
                raise RoutingError(f"header {name!r} is not a string")
            headers.append((name, value.encode()))
    if row.payload_bytes is not None:
        value_bytes: bytes | None = row.payload_bytes
    elif row.payload is not None:
        value_bytes = row.payload.encode()
    else:
        value_bytes = None  # a tombstone, as Debezium emits for a NULL payload
    return Message(topic, row.aggregate_id.encode(), value_bytes, headers)
