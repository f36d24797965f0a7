"""An example downstream service: keeps an order projection from the relay's `outbox.event.order` topic.

    CREATE TABLE order_projection (order_id text PRIMARY KEY, total numeric, seq bigint NOT NULL);

    postbox inbox consume --app postbox.inbox.example:inbox --topic outbox.event.order

Each event is applied once (the inbox claim) and a late, older snapshot never overwrites a newer one (the
version guard on `seq`). `postbox dev demo` runs it beside the relay.
"""

from __future__ import annotations

from typing import Any

from postbox.inbox import Inbox, Message
from postbox.inbox.helpers import upsert_snapshot

inbox = Inbox("orders-projection")


@inbox.handler("OrderChanged")
def project_order(tx: Any, message: Message) -> None:
    order = message.payload
    upsert_snapshot(
        tx,
        "public.order_projection",
        {"order_id": order["order"]},
        {"total": order["total"], "seq": order["seq"]},
        version_column="seq",
    )
