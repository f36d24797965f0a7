"""postbox inbox: effectively-once consumption of Kafka topics (and provider webhooks) into PostgreSQL."""

from postbox.inbox.handlers import Inbox, PayloadMismatch, PermanentError
from postbox.inbox.message import Message
from postbox.inbox.running import RunningConsumer, consume, consume_async, start_consumer

__all__ = [
    "Inbox",
    "Message",
    "PayloadMismatch",
    "PermanentError",
    "RunningConsumer",
    "consume",
    "consume_async",
    "start_consumer",
]
