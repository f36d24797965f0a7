"""The handler API: register a function per event type; it gets the open transaction and the message.

    from postbox.inbox import Inbox

    inbox = Inbox("billing")

    @inbox.handler("OrderPlaced")
    def charge(tx, message):
        tx.execute("INSERT INTO charges (order_id, amount) VALUES (%s, %s)",
                   (message.payload["id"], message.payload["total"]))

Run it with `postbox inbox consume --app billing.handlers:inbox --topics outbox.event.order`, or embed it
with `inbox.consume(inbox, database_url, kafka_bootstrap, topics)`. The handler runs inside the
transaction that claimed the message: commit or roll back together, so a message is applied effectively
once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from postbox.inbox.message import IdSource, Message
from postbox.relay.core.db import DEFAULT_SCHEMA

Transaction = psycopg.Connection[Any]
Handler = Callable[[Transaction, Message], None]
CommitHook = Callable[[list[Message]], None]


class PermanentError(Exception):
    """Raise from a handler when retrying cannot help: the message is parked at once with this reason."""


class Unhandled(PermanentError):
    """No handler is registered for the message's event type and there is no fallback."""

    def __init__(self, message: Message) -> None:
        found = f"event type {message.event_type!r}" if message.event_type is not None else "no event type"
        super().__init__(f"no handler for {found} and no fallback (Inbox(unhandled='ignore') skips such)")


class Inbox:
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
        self._handlers: dict[str, Handler] = {}
        self._fallback: Handler | None = None
        self._after_commit: list[CommitHook] = []

    def handler(self, event_type: str) -> Callable[[Handler], Handler]:
        def register(function: Handler) -> Handler:
            if event_type in self._handlers:
                raise ValueError(f"a handler for {event_type!r} is already registered")
            self._handlers[event_type] = function
            return function

        return register

    def fallback(self, function: Handler) -> Handler:
        """Runs for messages whose event type has no handler (or that carry no type)."""
        self._fallback = function
        return function

    def after_commit(self, function: CommitHook) -> CommitHook:
        """Runs after a batch's transaction commits and before its offsets are committed."""
        self._after_commit.append(function)
        return function

    def handler_for(self, message: Message) -> Handler | None:
        if message.event_type is not None and message.event_type in self._handlers:
            return self._handlers[message.event_type]
        return self._fallback

    def run_after_commit(self, messages: list[Message]) -> None:
        for hook in self._after_commit:
            hook(messages)
