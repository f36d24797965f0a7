"""Testing a service's handlers without a broker: messages handed straight to the inbox, applied on a real
PostgreSQL exactly as the consumer applies a batch it read (the claim, the handlers with their retries,
parking, the commit, the after_commit hooks). As faststream's TestBroker and procrastinate's in-memory
connector do for their users, but the database stays real: the handler's SQL is what is under test.

    from postbox.inbox.testing import InboxTester

    def test_an_order_change_updates_the_projection(database_url):
        with InboxTester(inbox, database_url) as tester:
            changed = tester.message("OrderChanged", {"order": "o-1", "total": "9.99", "seq": 1})
            [delivery] = tester.deliver(changed)
            assert delivery.status == "done"
            # ... then read the service's own tables

The database needs postbox's tables in the Inbox's schema (`postbox migrate`).
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from postbox.inbox.consumer import ConsumerSettings, InboxConsumer
from postbox.inbox.handlers import Inbox
from postbox.inbox.message import Message
from postbox.relay.core.db import connect


@dataclass(frozen=True)
class Delivery:
    """What became of one delivered message: `done` (applied), `duplicate` (its id was claimed already, so
    nothing ran) or `failed` (parked, with `error` saying why)."""

    message_id: str
    status: str
    error: str | None = None
    attempts: int = 0


class InboxTester:
    def __init__(self, inbox: Inbox, database_url: str, *, schema: str | None = None) -> None:
        """`schema`: where postbox's tables are, when not the Inbox's own (a test's schema, say)."""
        if schema is not None:
            inbox = copy.copy(inbox)  # the service's Inbox object is left as it is
            inbox.schema = schema
        self.inbox = inbox
        # No broker is contacted: apply_messages reads nothing from Kafka, and a dead-letter topic is not
        # produced to here (the parked row is what a test checks).
        settings = ConsumerSettings(database_url=database_url, kafka_bootstrap="no-broker:9092", topics=[])
        self._consumer = InboxConsumer(inbox, settings)
        self._database_url = database_url
        self._offsets = itertools.count()

    def message(
        self,
        event_type: str | None,
        payload: Any,
        *,
        message_id: str | None = None,
        topic: str = "test",
        key: bytes | None = None,
        headers: dict[str, bytes] | None = None,
    ) -> Message:
        """A message as the consumer would read it: `payload` JSON-encoded (bytes are taken as they are,
        None is a tombstone), a fresh id unless given, offsets counting up."""
        message_id = message_id or str(uuid.uuid4())
        value = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
        sent = {"id": message_id.encode(), **({"eventType": event_type.encode()} if event_type else {})}
        return Message(
            topic, 0, next(self._offsets), key, value, {**sent, **(headers or {})}, message_id, event_type
        )

    def deliver(self, *messages: Message) -> list[Delivery]:
        """Apply `messages` as one batch, committed; what became of each, in order."""
        ids = [m.message_id for m in messages]
        before = self._statuses(ids)
        self._consumer.apply_messages(list(messages))
        after = self._statuses(ids)
        deliveries = []
        for message_id in ids:
            status, error, attempts = after[message_id]
            if message_id in before:
                status = "duplicate"
            deliveries.append(Delivery(message_id, status, error, attempts))
            before.setdefault(message_id, after[message_id])  # a repeat inside the batch is a duplicate
        return deliveries

    def _statuses(self, ids: list[str]) -> dict[str, tuple[str, str | None, int]]:
        with connect(self._database_url, self.inbox.schema, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT message_id, status, error, attempts FROM inbox_message "
                "WHERE consumer = %s AND message_id = ANY(%s)",
                (self.inbox.consumer, ids),
            ).fetchall()
        return {str(m): (str(s), None if e is None else str(e), int(str(a))) for m, s, e, a in rows}

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> InboxTester:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
