"""The benchmark's downstream service: a handler that does nothing, so the figure is the inbox's own cost
(the claim insert, the savepoint, the commit, the offset commit)."""

from __future__ import annotations

from typing import Any

from postbox.inbox import Inbox, Message

inbox = Inbox("bench-noop")


@inbox.fallback
def ignore(tx: Any, message: Message) -> None:
    """Nothing to do: the claim row the inbox writes is the whole effect."""


# The same service with a handler that costs one INSERT per message (the smallest real handler).
writing = Inbox("bench-writing")

SCHEMA_SQL = "CREATE TABLE IF NOT EXISTS bench_effect (message_id text NOT NULL)"


@writing.fallback
def record(tx: Any, message: Message) -> None:
    tx.execute("INSERT INTO bench_effect (message_id) VALUES (%s)", (message.message_id,))
