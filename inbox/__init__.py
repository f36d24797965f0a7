"""postbox inbox: effectively-once consumption of Kafka topics (and provider webhooks) into PostgreSQL."""

from inbox.consumer import consume
from inbox.handlers import Inbox, PermanentError
from inbox.message import Message

__all__ = ["Inbox", "Message", "PermanentError", "consume"]
