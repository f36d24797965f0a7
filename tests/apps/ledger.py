"""The soak's downstream service: every applied event leaves one effect row (no unique key, so a double
application shows as two)."""

from __future__ import annotations

from typing import Any

from postbox.inbox import Inbox, Message

inbox = Inbox("ledger", max_attempts=5, retry_backoff=0.05)

SCHEMA_SQL = (
    "CREATE TABLE IF NOT EXISTS public.effects (message_id text NOT NULL, aggregate text, seq integer)"
)


@inbox.fallback
def apply(tx: Any, message: Message) -> None:
    tx.execute(
        "INSERT INTO public.effects VALUES (%s, %s, %s)",
        (message.message_id, message.key_text, message.payload["seq"]),
    )
