"""A consumed Kafka message as handlers see it, and how its idempotency key is found. Pure, no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any


class MessageIdMissing(ValueError):
    """The configured id source is absent from the message, or holds no usable id (not UTF-8, NUL, too
    long for the inbox's key); the message is parked under its coordinates, with this reason."""


# The inbox's primary key is (consumer, message_id); PostgreSQL caps a B-tree entry at about 2.7 kB.
MAX_MESSAGE_ID_BYTES = 1024


def usable_id(raw: bytes | str, where: str) -> str:
    """`raw` as a message id, or MessageIdMissing saying why it cannot be one. Invalid UTF-8 is refused,
    not replaced: two different byte strings must never become the same id (a false duplicate)."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MessageIdMissing(f"{where} is not UTF-8") from None
    else:
        text = raw
    if "\x00" in text:
        raise MessageIdMissing(f"{where} contains NUL (U+0000)")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise MessageIdMissing(f"{where} is not valid Unicode (a lone surrogate)") from None
    if size > MAX_MESSAGE_ID_BYTES:
        raise MessageIdMissing(f"{where} is {size} bytes, over the {MAX_MESSAGE_ID_BYTES} an id may have")
    return text


@dataclass(frozen=True)
class Message:
    """A consumed Kafka record as a handler gets it: its coordinates, key, value and headers, the id it is
    applied once under (`message_id`) and its event type (the header handlers are chosen by). `payload` is
    the value as JSON, or the handler's `payload_type` when it registered one."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    message_id: str
    event_type: str | None
    timestamp_ms: int | None = None

    @property
    def key_text(self) -> str | None:
        """The key as text (undecodable bytes replaced), None without a key."""
        return None if self.key is None else self.key.decode("utf-8", errors="replace")

    @cached_property
    def payload(self) -> Any:
        """The value as JSON (None for a tombstone). Raises ValueError for a value that is not JSON."""
        if self.value is None:
            return None
        return json.loads(self.value)

    @property
    def coordinates(self) -> str:
        return coordinates(self.topic, self.partition, self.offset)

    def with_payload(self, decoded: Any) -> Message:
        """This message with `payload` already decoded (to the type its handler asked for)."""
        copy = replace(self)
        copy.__dict__["payload"] = decoded  # what cached_property would store: the value, computed once
        return copy


def coordinates(topic: str, partition: int, offset: int) -> str:
    return f"{topic}/{partition}/{offset}"


@dataclass(frozen=True)
class IdSource:
    """Where a message's id lives: `header:NAME` (default `header:id`), `payload:a.b.c`, or `coordinates`.

    `coordinates` (topic/partition/offset) is the last resort: it deduplicates redelivery of the same
    record, not a producer that sent the same event twice.
    """

    kind: str
    name: str = ""

    @classmethod
    def parse(cls, text: str, *, allow_coordinates: bool = True) -> IdSource:
        """The one parser of this mini-language, for message ids and for the generic webhook provider's
        id and type (which have no coordinates)."""
        kind, _, name = text.partition(":")
        if allow_coordinates and kind == "coordinates" and not name:
            return cls("coordinates")
        if kind in ("header", "payload") and name:
            return cls(kind, name)
        if allow_coordinates:
            raise ValueError(f"message-id source {text!r}: use header:NAME, payload:PATH or coordinates")
        raise ValueError(f"source {text!r}: use header:NAME or payload:PATH")

    def extract(
        self, topic: str, partition: int, offset: int, headers: dict[str, bytes], value: bytes | None
    ) -> str:
        if self.kind == "coordinates":
            return coordinates(topic, partition, offset)
        if self.kind == "header":
            raw = headers.get(self.name)
            if raw is None or not raw.strip():
                raise MessageIdMissing(f"no {self.name!r} header")
            return usable_id(raw, f"header {self.name!r}")
        try:
            document: Any = json.loads(value) if value is not None else None
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for json's parser
            raise MessageIdMissing("value is not JSON, so payload path cannot be read") from None
        node = payload_field(document, self.name)
        if node is None:
            raise MessageIdMissing(f"no {self.name!r} in the payload")
        if isinstance(node, dict | list) or node == "":
            raise MessageIdMissing(f"payload {self.name!r} is not a scalar id")
        return usable_id(str(node), f"payload {self.name!r}")


def payload_field(document: Any, path: str) -> Any:
    """The value at a dotted path (`a.b.c`) of a parsed JSON document; None where the path is absent."""
    node = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def event_type_of(headers: dict[str, bytes], type_header: str) -> str | None:
    raw = headers.get(type_header)
    return raw.decode("utf-8", errors="replace") if raw else None
