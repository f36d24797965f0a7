"""postbox: a transactional-outbox relay and an idempotent inbox for PostgreSQL and Apache Kafka.

What a service imports is here, under one name that cannot collide with a service's own packages:

    from postbox import enqueue          # write an event in the caller's transaction
    from postbox import Inbox, Message   # consume the topics idempotently

The code lives in the repository's top-level folders `relay/` and `inbox/`; this package reaches them as
`postbox.relay` and `postbox.inbox` (symbolic links in a checkout, real folders inside the wheel), so a
service with packages of its own called `relay` or `inbox` gets its own.
"""

from postbox.inbox import (
    Inbox,
    Message,
    PayloadMismatch,
    PermanentError,
    RunningConsumer,
    consume,
    consume_async,
    start_consumer,
)
from postbox.relay import __version__
from postbox.relay.outbox.enqueue import (
    OutboxEvent,
    PayloadError,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)

__all__ = [
    "Inbox",
    "Message",
    "OutboxEvent",
    "PayloadError",
    "PayloadMismatch",
    "PermanentError",
    "RunningConsumer",
    "__version__",
    "consume",
    "consume_async",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "start_consumer",
]
