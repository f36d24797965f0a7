"""The receiver's writes, shared between concurrent requests: group commit inside the process.

Each request used to cost one INSERT and one commit of its own, and the receiver's time went mostly into
driving those statements (psycopg and the event loop), not into PostgreSQL. Here a request hands its
events over and waits; at most `max_in_flight` statements run at once, and the requests that arrive
while they run go into the next statement together. Under light load every request still gets its own
statement at once (nothing waits for a timer); under heavy load one statement and one commit serve many.

What each request is told is exactly what happened to its own events:
- its future resolves only after the statement holding its events has committed (autocommit: one
  statement is one transaction), so an answer of 200 still means the events are durable;
- the statement is atomic, so when it fails nothing of it was stored. When the database is unavailable or
  the statement lost a race (a deadlock, a lock timeout: transient_database_error, after the insert's own
  retries), every request of the group gets that error (503: the provider retries). When the database
  refused the data (a value jsonb or the key cannot hold), each request of the group is stored again on
  its own, so only the request that carries the bad value is refused;
- an event that two requests of one group both carry is stored once: the first request counts it as
  stored, the other as a duplicate, as if they had come one after the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import psycopg

from postbox.inbox.webhooks.providers import IncomingEvent
from postbox.relay.core.db import transient_database_error

EventKey = tuple[str, str]  # (provider, event_id): the webhook inbox's primary key
# Runs one INSERT of these events (one statement, committed when it returns); the keys it stored.
Insert = Callable[[Sequence[IncomingEvent]], Awaitable[set[EventKey]]]


@dataclass
class _Waiting:
    events: list[IncomingEvent]
    answer: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def resolve(self, stored: int) -> None:
        if not self.answer.done():  # the request may have gone (cancelled) while its statement ran
            self.answer.set_result(stored)

    def fail(self, exc: BaseException) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


def stored_per_request(requests: Sequence[Sequence[IncomingEvent]], stored: set[EventKey]) -> list[int]:
    """How many of each request's events were new, given the keys one statement stored for all of them:
    a key goes to the first request (and the first of its events) that carries it."""
    unclaimed = set(stored)
    counts = []
    for events in requests:
        count = 0
        for event in events:
            key = (event.provider, event.event_id)
            if key in unclaimed:
                unclaimed.discard(key)
                count += 1
        counts.append(count)
    return counts


class GroupInsert:
    def __init__(self, insert: Insert, max_in_flight: int = 2, max_events: int = 500) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._insert = insert
        self.max_in_flight = max_in_flight
        self.max_events = max_events  # per statement; one request's events are never split
        self._queue: list[_Waiting] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()  # held so a running statement is not collected

    async def store(self, events: list[IncomingEvent]) -> int:
        """Store these events (deduplicating) once the statement holding them commits; how many were
        new. Raises the psycopg error of the statement when they could not be stored."""
        waiting = _Waiting(events)
        self._queue.append(waiting)
        self._start_statements()
        return await waiting.answer

    def _start_statements(self) -> None:
        while self._queue and self._in_flight < self.max_in_flight:
            group: list[_Waiting] = []
            size = 0
            while self._queue and (not group or size + len(self._queue[0].events) <= self.max_events):
                waiting = self._queue.pop(0)
                group.append(waiting)
                size += len(waiting.events)
            self._in_flight += 1
            task = asyncio.create_task(self._run(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, group: list[_Waiting]) -> None:
        try:
            await self._store_group(group)
        except asyncio.CancelledError as exc:
            for waiting in group:
                waiting.fail(exc)
            raise
        except Exception as exc:  # noqa: BLE001  (a bug: each request of the group raises it, answers 500 and logs it)
            for waiting in group:
                waiting.fail(exc)
        finally:
            self._in_flight -= 1
            self._start_statements()

    async def _store_group(self, group: list[_Waiting]) -> None:
        try:
            stored = await self._insert([event for waiting in group for event in waiting.events])
        except psycopg.Error as exc:
            # Only a refusal of the data is looked for request by request; a transient error is nobody's.
            if len(group) == 1 or transient_database_error(exc):
                for waiting in group:
                    waiting.fail(exc)
                return
            # The data of some request was refused: find it by storing each request on its own.
            for waiting in group:
                try:
                    alone = await self._insert(waiting.events)
                except psycopg.Error as own:
                    waiting.fail(own)
                else:
                    waiting.resolve(stored_per_request([waiting.events], alone)[0])
            return
        for waiting, count in zip(group, stored_per_request([w.events for w in group], stored), strict=True):
            waiting.resolve(count)
