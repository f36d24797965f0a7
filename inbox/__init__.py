"""postbox inbox: effectively-once consumption of Kafka topics (and provider webhooks) into PostgreSQL."""

from postbox.inbox.consumer import consume
from postbox.inbox.handlers import Inbox, PermanentError
from postbox.inbox.message import Message

__all__ = ["Inbox", "Message", "PermanentError", "consume"]
