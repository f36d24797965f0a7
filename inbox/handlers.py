"""The handler API: register a function per event type; it gets the open transaction and the message.

    from postbox.inbox import Inbox

    inbox = Inbox("billing")

    @inbox.handler("OrderPlaced")
    def charge(tx, message):
        tx.execute("INSERT INTO charges (order_id, amount) VALUES (%s, %s)",
                   (message.payload["id"], message.payload["total"]))

Run it with `postbox inbox consume --app billing.handlers:inbox --topics outbox.event.order`, or embed it
with `postbox.consume(inbox, database_url, kafka_bootstrap, topics)`. The handler runs inside the
transaction that claimed the message: commit or roll back together, so a message is applied effectively
once.

A handler may be `async def`: it is awaited with a psycopg `AsyncConnection` in that same transaction
(`await tx.execute(...)`); `def` and `async def` handlers mix freely in one Inbox, each getting the
connection of its own kind (inbox.calling). A handler can ask for its payload typed:
`@inbox.handler("OrderChanged", payload_type=OrderChanged)` with a pydantic v2 model or a dataclass, and
`message.payload` is then an `OrderChanged`; a payload that does not fit is parked with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import psycopg

from postbox.inbox.calling import HandlerCaller, HandlerNotRun, check_callable, is_async
from postbox.inbox.message import IdSource, Message
from postbox.relay.core.db import DEFAULT_SCHEMA

Transaction = psycopg.Connection[Any]
AsyncTransaction = psycopg.AsyncConnection[Any]
Handler = Callable[[Transaction, Message], None] | Callable[[AsyncTransaction, Message], Awaitable[None]]
CommitHook = Callable[[list[Message]], None] | Callable[[list[Message]], Awaitable[None]]
H = TypeVar("H", bound=Handler)
C = TypeVar("C", bound=CommitHook)


class PermanentError(Exception):
    """Raise from a handler when retrying cannot help: the message is parked at once with this reason."""


class PayloadMismatch(PermanentError):
    """The payload does not decode to the type its handler asked for."""


# Failures that retrying cannot mend: the message is parked at once.
PERMANENT = (PermanentError, HandlerNotRun)


class Registered(NamedTuple):
    function: Handler
    payload_type: type[Any] | None


def check_payload_type(payload_type: object) -> None:
    """A pydantic v2 model or a dataclass; refused at registration otherwise."""
    if payload_type is None:
        return
    if not isinstance(payload_type, type) or not (
        callable(getattr(payload_type, "model_validate", None)) or dataclasses.is_dataclass(payload_type)
    ):
        raise TypeError(f"payload_type: {payload_type!r} is neither a pydantic v2 model nor a dataclass")


def decode_payload(message: Message, payload_type: type[Any]) -> Message:
    """`message` with its payload decoded to `payload_type` (raises PayloadMismatch, with why, when it does
    not fit): a pydantic model validates the JSON; a dataclass takes its fields by name, no more, no less."""
    try:
        document = message.payload
    except ValueError as exc:  # not JSON (json.JSONDecodeError is a ValueError)
        raise PayloadMismatch(f"payload is not JSON, so not a {payload_type.__name__}: {exc}") from None
    try:
        if callable(getattr(payload_type, "model_validate", None)):
            decoded = payload_type.model_validate(document)
        elif isinstance(document, dict):
            decoded = payload_type(**document)
        else:
            raise TypeError(f"a JSON object is needed, not {type(document).__name__}")
    except Exception as exc:  # noqa: BLE001  (whatever the type's own validation raises says why)
        raise PayloadMismatch(f"payload is not a {payload_type.__name__}: {exc}") from None
    return message.with_payload(decoded)


class Unhandled(PermanentError):
    """No handler is registered for the message's event type and there is no fallback."""

    def __init__(self, message: Message) -> None:
        found = f"event type {message.event_type!r}" if message.event_type is not None else "no event type"
        super().__init__(f"no handler for {found} and no fallback (Inbox(unhandled='ignore') skips such)")


class Inbox:
    """A downstream service's handlers, one per event type, each given the open transaction and the message;
    every message is applied once per `consumer` (the name its claims are kept under, and the default
    consumer group).

    `message_id` says where a message's id is: `"header:NAME"` (the relay's `id` header by default),
    `"payload:a.b.c"` or `"coordinates"`. `event_type_header` names the header handlers are chosen by (the
    relay's `eventType`). A handler that raises (but for PermanentError, which parks its message at once)
    is tried again after a random wait that grows exponentially from `retry_backoff` seconds (at most 10),
    `max_attempts` attempts in all; then its message is parked, and also produced to `dead_letter_topic`
    when one is given. A message no handler takes is parked (`unhandled="park"`) or recorded done
    (`unhandled="ignore"`). `schema` holds the inbox's tables.
    """

    def __init__(
        self,
        consumer: str,
        *,
        message_id: str = "header:id",
        event_type_header: str = "eventType",
        max_attempts: int = 5,
        retry_backoff: float = 0.2,
        dead_letter_topic: str | None = None,
        unhandled: str = "park",
        schema: str = DEFAULT_SCHEMA,
    ) -> None:
        if not consumer or len(consumer) > 200:
            raise ValueError("consumer: a name of 1-200 characters is required")
        if not 1 <= max_attempts <= 100:
            raise ValueError(f"max-attempts: {max_attempts} is outside 1..100")
        if unhandled not in ("park", "ignore"):
            raise ValueError(f"unhandled: {unhandled!r} is park or ignore")
        self.consumer = consumer
        self.id_source = IdSource.parse(message_id)
        self.event_type_header = event_type_header
        self.max_attempts = max_attempts
        self.retry_backoff = retry_backoff
        self.dead_letter_topic = dead_letter_topic
        # A message no handler (and no fallback) takes: parked with the reason, so a missing handler or a
        # missing eventType header shows up and can be requeued; "ignore" records it done on purpose.
        self.unhandled = unhandled
        self.schema = schema
        self._handlers: dict[str, Registered] = {}
        self._fallback: Registered | None = None
        self._after_commit: list[CommitHook] = []

    def handler(self, event_type: str, *, payload_type: type[Any] | None = None) -> Callable[[H], H]:
        """Register the handler of `event_type`: `def f(tx, message)` or `async def f(tx, message)`."""
        check_payload_type(payload_type)

        def register(function: H) -> H:
            check_callable(function, f"handler for {event_type!r}", 2)
            if event_type in self._handlers:
                raise ValueError(f"a handler for {event_type!r} is already registered")
            self._handlers[event_type] = Registered(function, payload_type)
            return function

        return register

    def fallback(self, function: H) -> H:
        """Runs for messages whose event type has no handler (or that carry no type)."""
        check_callable(function, "fallback handler", 2)
        self._fallback = Registered(function, None)
        return function

    def after_commit(self, function: C) -> C:
        """Runs after a batch's transaction commits and before its offsets are committed, with the
        messages the batch applied; `def` or `async def`."""
        check_callable(function, "after_commit hook", 1)
        self._after_commit.append(function)
        return function

    def awaits(self) -> bool:
        """Whether any handler or hook is async (the consumer then needs a thread without an event loop)."""
        functions = [r.function for r in self._handlers.values()] + list(self._after_commit)
        return any(is_async(f) for f in functions + ([self._fallback.function] if self._fallback else []))

    def handler_for(self, message: Message) -> Registered | None:
        if message.event_type is not None and message.event_type in self._handlers:
            return self._handlers[message.event_type]
        return self._fallback

    def run_after_commit(self, messages: list[Message], calls: HandlerCaller) -> None:
        for hook in self._after_commit:
            calls.plain(hook, messages)
