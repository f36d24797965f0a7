"""The receiver's group commit (inbox.webhooks.group_insert): which requests share a statement and what
each is told. The statement is a stand-in here; the real one runs against PostgreSQL in
tests/integration/test_webhooks.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import psycopg
import pytest

from postbox.inbox.webhooks.group_insert import EventKey, GroupInsert, stored_per_request
from postbox.inbox.webhooks.providers import IncomingEvent


def event(event_id: str, provider: str = "stripe") -> IncomingEvent:
    return IncomingEvent(provider, event_id, "t", {})


class Table:
    """Keeps what was stored; each statement waits on `gate` so requests can pile up behind it."""

    def __init__(self, refuse: str | None = None, unavailable: bool = False) -> None:
        self.rows: set[EventKey] = set()
        self.statements: list[list[str]] = []
        self.gate = asyncio.Event()
        self.refuse, self.unavailable = refuse, unavailable

    async def insert(self, events: Sequence[IncomingEvent]) -> set[EventKey]:
        self.statements.append([e.event_id for e in events])
        await self.gate.wait()
        if self.unavailable:
            raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")
        if self.refuse in {e.event_id for e in events}:
            raise psycopg.errors.InvalidParameterValue("the trigger refused it")
        new = {(e.provider, e.event_id) for e in events} - self.rows
        self.rows |= new
        return new


def test_each_request_counts_the_events_it_brought_first() -> None:
    requests = [[event("a"), event("b")], [event("b"), event("c")], [event("a")], [event("c"), event("c")]]
    stored = {("stripe", "a"), ("stripe", "b"), ("stripe", "c")}
    assert stored_per_request(requests, stored) == [2, 1, 0, 0]
    assert stored_per_request(requests, set()) == [0, 0, 0, 0], "all of them were already there"
    assert stored_per_request([[event("a", "shopify")]], {("stripe", "a")}) == [0], "the key has the provider"


async def _store_concurrently(
    writes: GroupInsert, table: Table, requests: list[list[IncomingEvent]]
) -> list[int | BaseException]:
    tasks = [asyncio.create_task(writes.store(events)) for events in requests]
    await asyncio.sleep(0)  # every request queues; the first statements start
    table.gate.set()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def test_requests_arriving_together_share_statements_and_each_is_told_its_own_count() -> None:
    async def scenario() -> None:
        table = Table()
        writes = GroupInsert(table.insert, max_in_flight=2)
        requests = [[event(f"e{i}")] for i in range(10)] + [[event("e3")], [event("e0"), event("new")]]
        answers = await _store_concurrently(writes, table, requests)
        assert answers == [1] * 10 + [0, 1]
        # The first two start alone (nothing waits for a timer); the other ten go into the next statement.
        assert len(table.statements) == 3, table.statements
        assert table.statements[0] == ["e0"]
        assert table.statements[1] == ["e1"]
        assert len(table.rows) == 11

    asyncio.run(scenario())


def test_a_statement_never_splits_a_request_and_stays_near_its_event_cap() -> None:
    async def scenario() -> None:
        table = Table()
        writes = GroupInsert(table.insert, max_in_flight=1, max_events=5)
        requests = [[event(f"r{i}-{j}") for j in range(3)] for i in range(5)]
        answers = await _store_concurrently(writes, table, requests)
        assert answers == [3] * 5
        assert [len(s) for s in table.statements] == [3, 3, 3, 3, 3], "3 + 3 would pass the cap of 5"

    asyncio.run(scenario())


def test_refused_data_fails_only_the_request_that_carries_it() -> None:
    async def scenario() -> None:
        table = Table(refuse="bad")
        writes = GroupInsert(table.insert, max_in_flight=1)
        requests = [[event("first")], [event("a")], [event("bad")], [event("b")]]
        answers = await _store_concurrently(writes, table, requests)
        assert answers[0] == 1
        assert answers[1] == 1
        assert answers[3] == 1
        assert isinstance(answers[2], psycopg.errors.InvalidParameterValue)
        assert table.rows == {("stripe", "first"), ("stripe", "a"), ("stripe", "b")}
        # first alone; then a+bad+b together (refused), then each of them alone
        assert table.statements == [["first"], ["a", "bad", "b"], ["a"], ["bad"], ["b"]]

    asyncio.run(scenario())


def test_the_database_unavailable_fails_the_whole_group_without_retrying_each() -> None:
    async def scenario() -> None:
        table = Table(unavailable=True)
        writes = GroupInsert(table.insert, max_in_flight=1)
        answers = await _store_concurrently(writes, table, [[event("a")], [event("b")], [event("c")]])
        assert all(isinstance(a, psycopg.errors.AdminShutdown) for a in answers)
        assert table.statements == [["a"], ["b", "c"]], "no one-by-one retry against a database that is gone"
        assert not table.rows

    asyncio.run(scenario())


def test_a_request_that_goes_away_does_not_disturb_the_rest_of_its_group() -> None:
    async def scenario() -> None:
        table = Table()
        writes = GroupInsert(table.insert, max_in_flight=1)
        first = asyncio.create_task(writes.store([event("first")]))
        await asyncio.sleep(0)  # one turn of the loop (no time passes): the first statement starts
        leaving = asyncio.create_task(writes.store([event("leaving")]))
        staying = asyncio.create_task(writes.store([event("staying")]))
        await asyncio.sleep(0)  # one turn of the loop: both queue behind it, as one group
        leaving.cancel()
        table.gate.set()
        assert await first == 1
        assert await staying == 1
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert ("stripe", "leaving") in table.rows, (
            "its statement ran: a retry by the provider is a duplicate"
        )

    asyncio.run(scenario())


def test_a_bug_in_the_statement_reaches_every_request_of_the_group_and_the_next_ones_still_run() -> None:
    calls: list[int] = []

    async def broken_once(events: Sequence[IncomingEvent]) -> set[EventKey]:
        calls.append(len(events))
        if len(calls) <= 2:
            raise RuntimeError("a bug")
        return {(e.provider, e.event_id) for e in events}

    async def scenario() -> None:
        writes = GroupInsert(broken_once, max_in_flight=1)
        answers = await asyncio.gather(
            *(writes.store([event(str(i))]) for i in range(3)), return_exceptions=True
        )
        assert all(isinstance(a, RuntimeError) for a in answers), answers
        assert calls == [1, 2], "not retried one by one: a bug is no data error"
        assert await writes.store([event("later")]) == 1, "the statement slot was given back"

    asyncio.run(scenario())
