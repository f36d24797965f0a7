"""Log mode's held aggregates: those with a row parked while its topic cannot take messages. Pure, no I/O.

A blocked topic (unknown, not authorised) would otherwise hold back a whole shard: its cursor cannot pass
the row. Instead the row is parked as held, with the topic it waits for, and so is every later row of its
aggregate (in this batch and the ones after), so that per-aggregate order holds while the rest of the
shard flows. The relay puts a topic's held rows back in the queue once the topic takes messages.

The relay's lanes read it from their threads (each lane its own shards) and the main loop replaces it at
each lease renewal (when shards change hands), so every access holds the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class HeldAggregates:
    def __init__(self) -> None:
        self._held: dict[tuple[int, str], str] = {}  # (shard, aggregate id) -> the topic it waits for
        self._lock = threading.Lock()

    def load(self, rows: Iterable[tuple[int, str, str]]) -> None:
        """Replace what is known with the database's (shard, aggregate id, topic) rows."""
        held = {(shard, aggregate): topic for shard, aggregate, topic in rows}
        with self._lock:
            self._held = held

    def waits_for(self, shard: int, aggregate_id: str) -> str | None:
        """The topic this aggregate waits for, or None when it is not held."""
        if not self._held:  # the usual case, without the lock: a dict's truth is read atomically
            return None
        with self._lock:
            return self._held.get((shard, aggregate_id))

    def hold(self, shard: int, aggregate_id: str, topic: str) -> None:
        with self._lock:
            self._held.setdefault((shard, aggregate_id), topic)

    def release(self, topic: str) -> None:
        """Forget the aggregates held for `topic` (before their rows go back to the queue)."""
        with self._lock:
            self._held = {key: waits for key, waits in self._held.items() if waits != topic}

    def topics(self) -> set[str]:
        with self._lock:
            return set(self._held.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
