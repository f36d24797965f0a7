"""The outbox side: application code enqueues events in its own transaction; the relay daemon publishes them.

from postbox.relay.outbox import enqueue
with conn.transaction():
    conn.execute("INSERT INTO orders ...")
    event_id = enqueue(conn, "order", order_id, "OrderCreated", {"id": order_id, "total": "9.99"})
"""

from postbox.relay.outbox.enqueue import (
    OutboxEvent,
    PayloadError,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)

__all__ = ["OutboxEvent", "PayloadError", "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]
