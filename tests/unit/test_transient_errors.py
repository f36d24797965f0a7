"""relay.core.db.transient_database_error, without servers: which database errors are retried (nobody's
bad input) and which belong to the row or message (parked). The daemons' behaviour on real servers is in
tests/integration/test_transient_db_errors.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import errors

from postbox.relay.core.db import database_unavailable, transient_database_error


@pytest.mark.parametrize(
    "exc",
    [
        errors.DeadlockDetected("deadlock detected"),
        errors.SerializationFailure("could not serialize access due to concurrent update"),
        errors.LockNotAvailable("canceling statement due to lock timeout"),
        errors.QueryCanceled("canceling statement due to statement timeout"),
        errors.SnapshotTooOld("snapshot too old"),
        errors.IdleInTransactionSessionTimeout("terminating connection due to idle-in-transaction timeout"),
        errors.lookup("25P04")("terminating connection due to transaction timeout"),
        # the database gone or struggling (database_unavailable) is transient too
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.TooManyConnections("sorry, too many clients already"),
        psycopg.OperationalError("server closed the connection unexpectedly"),  # no SQLSTATE: the socket
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_races_and_a_lost_database_are_transient(exc: Exception) -> None:
    assert transient_database_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        errors.UniqueViolation("duplicate key value"),
        errors.ProgramLimitExceeded("index row size exceeds maximum"),  # an OperationalError, and bad data
        errors.UntranslatableCharacter("NUL"),
        errors.InvalidTextRepresentation("invalid input syntax for type json"),
        errors.lookup("40002")("deferred constraint violated at commit"),  # class 40, but the data's fault
        errors.InFailedSqlTransaction("current transaction is aborted"),  # the caller's bug
        errors.UndefinedTable("relation does not exist"),  # a schema problem: fail loudly, do not loop
        ValueError("not a database error"),
        RuntimeError("a handler's own failure"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_errors_of_the_data_or_the_code_are_not_transient(exc: Exception) -> None:
    assert not transient_database_error(exc)


def test_an_application_error_raised_from_a_deadlock_is_judged_by_the_deadlock() -> None:
    def wrapped(cause: BaseException) -> Exception:
        try:
            raise cause
        except BaseException as exc:  # noqa: BLE001
            try:
                raise RuntimeError("could not update the balance") from exc
            except RuntimeError as outer:
                return outer

    assert transient_database_error(wrapped(errors.DeadlockDetected("deadlock detected")))
    assert transient_database_error(wrapped(wrapped(errors.SerializationFailure("serialize"))))
    assert not transient_database_error(wrapped(errors.UniqueViolation("duplicate key value")))
    assert not transient_database_error(wrapped(ValueError("bad amount")))


def test_only_an_explicit_cause_counts_not_an_error_handled_on_the_way() -> None:
    """`raise X` inside an `except` block sets X.__context__ only: the handler met a deadlock, dealt
    with it, and failed for a reason of its own."""

    def handler() -> None:
        try:
            raise errors.DeadlockDetected("deadlock detected")
        except errors.DeadlockDetected:
            raise ValueError("negative amount")  # noqa: B904

    with pytest.raises(ValueError, match="negative amount") as caught:
        handler()
    assert isinstance(caught.value.__context__, errors.DeadlockDetected)
    assert not transient_database_error(caught.value)


def test_a_cycle_of_causes_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert not transient_database_error(first)


@dataclass
class FakeConnection:
    broken: bool


def test_a_broken_connection_is_transient_whatever_the_error_says() -> None:
    conn = FakeConnection(broken=True)
    exc = ValueError("a handler's error after the server went away")
    assert transient_database_error(exc, conn)  # type: ignore[arg-type]
    assert not transient_database_error(exc, FakeConnection(broken=False), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc",
    [
        errors.DeadlockDetected("deadlock detected"),
        errors.SerializationFailure("serialize"),
        errors.LockNotAvailable("lock timeout"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_lost_race_keeps_the_connection(exc: Exception) -> None:
    """Transient but not unavailable: the daemons retry on the same connection (no reconnect)."""
    assert transient_database_error(exc)
    assert not database_unavailable(exc)


# -- where the rule decides: the receiver's group commit ----------------------------------------------------


def test_a_group_statement_that_lost_a_race_fails_its_requests_without_looking_for_a_culprit() -> None:
    """A refusal of the data is looked for request by request (only the culprit gets its 400); a deadlock
    is nobody's data, so every request of the group gets it (503, the provider retries) and no request
    is stored alone, which would only repeat the race. (The statement is a stand-in: what the receiver
    answers on real servers is in tests/integration/test_transient_db_errors.py.)"""
    from postbox.inbox.webhooks.group_insert import EventKey, GroupInsert  # noqa: PLC0415
    from postbox.inbox.webhooks.providers import IncomingEvent  # noqa: PLC0415

    statements: list[list[str]] = []
    gate = asyncio.Event()

    async def deadlocking(events: Sequence[IncomingEvent]) -> set[EventKey]:
        statements.append([e.event_id for e in events])
        await gate.wait()
        raise errors.DeadlockDetected("deadlock detected")

    async def scenario() -> list[int | BaseException]:
        writes = GroupInsert(deadlocking, max_in_flight=1)
        requests = [[IncomingEvent("stripe", name, "t", {})] for name in ("a", "b", "c")]
        tasks = [asyncio.create_task(writes.store(events)) for events in requests]
        await asyncio.sleep(0)  # every request queues behind the first statement
        gate.set()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    answers = asyncio.run(scenario())
    assert all(isinstance(a, errors.DeadlockDetected) for a in answers), answers
    assert statements == [["a"], ["b", "c"]], "no request stored alone after a lost race"
