"""Which topics take messages: those known good, and those held back by a configuration error (a topic
that does not exist where auto-creation is off, one this relay may not write to), with the rows a read
leaves out while they are."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import structlog

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import Delivery

log = structlog.get_logger("postbox.relay")


@dataclass
class TopicGate:
    """Topics known to be usable, and those held back by a configuration error with their row filter.

    Lanes read and change it from their threads, and /readyz reads it from the ops server's: every change
    and every walk over it holds the lock."""

    good: set[str] = field(default_factory=set)
    blocked: dict[str, str] = field(default_factory=dict)  # topic -> reason
    blocked_types: dict[str, set[str]] = field(default_factory=dict)  # topic -> aggregate types routed there
    next_recheck: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def block(self, topic: str, reason: str, aggregate_type: str | None) -> None:
        with self._lock:
            if topic not in self.blocked:
                log.error("relay_topic_blocked", topic=topic, reason=reason)
            self.good.discard(topic)
            self.blocked[topic] = reason
            if aggregate_type is not None:
                self.blocked_types.setdefault(topic, set()).add(aggregate_type)

    def unblock(self, topic: str) -> None:
        with self._lock:
            self.blocked.pop(topic, None)
            self.blocked_types.pop(topic, None)

    def known(self, topic: str) -> tuple[bool, Delivery | None]:
        """(whether the topic is known, and then None when it is good, else why it is blocked)."""
        with self._lock:
            if topic in self.good:
                return True, None
            reason = self.blocked.get(topic)
        return (False, None) if reason is None else (True, Delivery(Disposition.TOPIC_BLOCKED, reason))

    def mark_good(self, topic: str) -> None:
        with self._lock:
            if len(self.good) >= 4096:  # writers choose topics: a bounded memory, checked again when cleared
                self.good.clear()
            self.good.add(topic)

    def reasons(self) -> dict[str, str]:
        with self._lock:
            return dict(self.blocked)

    def claim_filter(self) -> tuple[list[str], list[str]]:
        """(the blocked topics, the aggregate types routed to them): rows a read leaves out."""
        with self._lock:
            types = sorted({t for types in self.blocked_types.values() for t in types})
            return sorted(self.blocked), types
