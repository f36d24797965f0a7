"""Transient database errors on real servers: a deadlock, a lock timeout or a serialization failure is
nobody's bad input. Each daemon retries the work (never parks a message or an event for it, never dies of
it), and the claims take their row locks in one order so that two consumers do not deadlock each other.

"Another session" below is a plain connection of the test's, holding a lock the way a second consumer, an
operator's transaction or a long migration would, and letting go when the test says so."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from postbox.inbox.applying import QUERIES as INBOX_QUERIES
from postbox.inbox.webhooks.providers import IncomingEvent
from postbox.inbox.webhooks.store import INSERT_EVENTS, insert_params, store_events
from postbox.relay.core.db import connect
from postbox.relay.core.sql import query
from tests.apps.bank import APP
from tests.apps.hooks import SCHEMA_SQL as HOOKS_SCHEMA_SQL
from tests.support.bank import deposits, effects
from tests.support.kafka import create_topic, produce
from tests.support.processes import InboxProcess, ReceiverProcess, WorkerProcess
from tests.support.servers import Servers
from tests.support.waiting import holds_for, wait_until
from tests.support.webhooks import applied, stripe_body, stripe_headers, wait_settled

Conn = psycopg.Connection[tuple[object, ...]]
CLAIM_MESSAGES = query(INBOX_QUERIES, "claim_messages")
CONSUMER = "bank"  # tests.apps.bank's inbox


def with_settings(database_url: str, **gucs: str) -> str:
    """The URL with session settings for every connection made from it (libpq's `options`)."""
    return make_conninfo(database_url, options=" ".join(f"-c {name}={value}" for name, value in gucs.items()))


@pytest.fixture
def other(servers: Servers, schema: str) -> Iterator[Conn]:
    """Another session in the test's schema, in a transaction (not autocommit): what it writes stays
    locked until the test rolls it back."""
    with connect(servers.database_url, schema) as conn:
        yield conn


def waiting_on(db: Conn, holder: Conn) -> int:
    """How many sessions wait for a lock `holder` holds."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))",
        (holder.info.backend_pid,),
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def claim_as_another_consumer(conn: Conn, message_id: str) -> None:
    """What a second instance of the consumer does for one message: claim it (and hold it until commit)."""
    conn.execute(
        "INSERT INTO inbox_message (consumer, message_id, topic, kafka_partition, kafka_offset) "
        "VALUES (%s, %s, 'another-partition', 0, 0) ON CONFLICT DO NOTHING",
        (CONSUMER, message_id),
    )


def inbox_rows(db: Conn) -> list[tuple[object, ...]]:
    return db.execute(
        "SELECT message_id, status, error FROM inbox_message WHERE consumer = %s ORDER BY message_id",
        (CONSUMER,),
    ).fetchall()


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001  (handed to the test, which asserts on it)
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# -- the inbox consumer ------------------------------------------------------------------------------------


def test_a_claim_that_times_out_on_another_sessions_lock_is_retried_and_the_message_applied_once(
    servers: Servers, schema: str, bank: Conn, other: Conn
) -> None:
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    events = deposits(3)
    produce(servers.kafka_bootstrap, topic, events)
    held = events[1][0]
    claim_as_another_consumer(other, held)  # uncommitted: the consumer's claim of `held` must wait
    url = with_settings(servers.database_url, lock_timeout="300ms")
    with InboxProcess(url, servers.kafka_bootstrap, schema, APP, [topic]) as consumer:
        wait_until(lambda: "55P03" in consumer.log(), 60, what="the consumer's claim timed out on the lock")
        wait_until(
            lambda: consumer.log().count("55P03") >= 3, 60, what="more timeouts while the other holds on"
        )
        other.rollback()  # the other session lets go without claiming: the message is still ours to apply
        wait_until(lambda: len(inbox_rows(bank)) == 3, 60, what="three messages settled")
        holds_for(
            lambda: consumer.process.poll() is None and set(effects(bank).values()) == {1},
            1,
            what="the consumer alive and no message applied twice (room for a late double application)",
        )
        assert consumer.terminate() == 0
    assert inbox_rows(bank) == [(e[0], "done", None) for e in sorted(events)], "nothing parked"
    assert effects(bank) == {e[0]: 1 for e in events}, "each message applied once, the held one included"


def test_a_deadlock_with_another_consumer_is_retried_and_never_parks_the_messages(
    servers: Servers, schema: str, bank: Conn, other: Conn
) -> None:
    """The reported case: another instance claims the same ids in another order (the same id on two
    partitions after a producer retry). The other session's deadlock_timeout is long, so this consumer is
    always the one that finds the deadlock and gets the 40P01."""
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    run = uuid.uuid4().hex[:8]
    a, b, c = (f"dep-{run}-{n}" for n in (1, 2, 3))
    payload: dict[str, object] = {"account": "acct", "amount": 1}
    produce(
        servers.kafka_bootstrap,
        topic,
        [(c, "Deposit", payload), (a, "Deposit", payload), (b, "Deposit", payload)],
    )
    other.execute("SET deadlock_timeout = '30s'")
    claim_as_another_consumer(other, b)
    # The consumer looks for a deadlock 2 s into a wait: time for the other session to close the cycle.
    url = with_settings(servers.database_url, deadlock_timeout="2s")
    with InboxProcess(url, servers.kafka_bootstrap, schema, APP, [topic]) as consumer:
        wait_until(lambda: waiting_on(bank, other) == 1, 60, what="the consumer waiting for b")
        # The other instance now wants a, which the consumer holds: a deadlock, found by the consumer.
        thread, errors = in_thread(lambda: claim_as_another_consumer(other, a))
        thread.join(30)
        assert not thread.is_alive()
        assert not errors, errors
        wait_until(lambda: waiting_on(bank, other) == 1, 60, what="the consumer waiting for the other again")
        # And then c: before the fix the consumer's one-by-one fallback held c here, a second deadlock.
        thread, errors = in_thread(lambda: claim_as_another_consumer(other, c))
        thread.join(30)
        assert not thread.is_alive()
        assert not errors, errors
        other.rollback()  # the other instance gives up its claims (say, it crashed): ours to apply
        wait_until(lambda: len(inbox_rows(bank)) == 3, 60, what="three messages settled")
        holds_for(
            lambda: consumer.process.poll() is None and set(effects(bank).values()) == {1},
            1,
            what="the consumer alive and no message applied twice (room for a late double application)",
        )
        assert "40P01" in consumer.log(), "the consumer did meet the deadlock"
        assert consumer.terminate() == 0
    assert inbox_rows(bank) == [(a, "done", None), (b, "done", None), (c, "done", None)], "nothing parked"
    assert effects(bank) == {a: 1, b: 1, c: 1}


# -- the claims' lock order ----------------------------------------------------------------------------------


def claim_messages(conn: Conn, ids: list[str]) -> list[str]:
    """The inbox consumer's claim statement, as the consumer runs it; the ids it inserted, in the order the
    statement inserted them (RETURNING gives the rows in the order the insert processed them)."""
    rows = conn.execute(
        CLAIM_MESSAGES,
        {
            "consumer": CONSUMER,
            "ids": ids,
            "topics": ["t"] * len(ids),
            "partitions": [0] * len(ids),
            "offsets": list(range(len(ids))),
            "keys": [None] * len(ids),
        },
    ).fetchall()
    return [str(r[0]) for r in rows]


def insert_events(conn: Conn, ids: list[str]) -> list[str]:
    """The webhook receiver's insert, as the receiver runs it; the event ids in insertion order."""
    events = [IncomingEvent("stripe", event_id, "invoice.paid", {"n": n}) for n, event_id in enumerate(ids)]
    return [str(r[1]) for r in conn.execute(INSERT_EVENTS, insert_params(events)).fetchall()]


@pytest.mark.parametrize("claim", [claim_messages, insert_events], ids=["inbox-claim", "webhook-insert"])
def test_two_claims_of_the_same_ids_in_opposite_orders_do_not_deadlock(
    servers: Servers, schema: str, db: Conn, claim: Callable[[Conn, list[str]], list[str]]
) -> None:
    """PostgreSQL inserts (and so locks) the rows of INSERT ... SELECT ... ORDER BY in that order. Without
    one order: the first claim holds b and waits for z, the second holds a and waits for b; once z is
    free, the first wants a: a deadlock. In one order, the second waits for a holding nothing, and both
    finish."""
    run = uuid.uuid4().hex[:8]
    a, b, z = f"{run}-a", f"{run}-b", f"{run}-z"
    with (
        connect(servers.database_url, schema) as holder,
        connect(servers.database_url, schema) as first,
        connect(servers.database_url, schema) as second,
    ):
        claim(holder, [z])
        results: dict[str, list[str]] = {}

        def first_claim() -> None:
            results["first"] = claim(first, [b, z, a])
            first.commit()

        def second_claim() -> None:
            results["second"] = claim(second, [a, b])
            second.commit()

        first_thread, first_errors = in_thread(first_claim)
        wait_until(lambda: waiting_on(db, holder) == 1, 30, what="the first claim waiting for z")
        second_thread, second_errors = in_thread(second_claim)
        wait_until(lambda: waiting_on(db, first) == 1, 30, what="the second claim waiting for the first")
        holder.rollback()
        first_thread.join(30)
        second_thread.join(30)
        assert not first_thread.is_alive()
        assert not second_thread.is_alive()
    assert first_errors == [], "no deadlock"
    assert second_errors == [], "no deadlock"
    assert results == {"first": [a, b, z], "second": []}
    assert claim(db, [f"{run}-3", f"{run}-1", f"{run}-2"]) == [f"{run}-1", f"{run}-2", f"{run}-3"], (
        "rows are inserted in id order, whatever the order they came in"
    )


# -- the webhook receiver and worker -----------------------------------------------------------------------


def test_the_receiver_answers_503_not_400_when_its_insert_times_out_on_a_lock_and_the_retry_lands(
    servers: Servers, schema: str, db: Conn, other: Conn
) -> None:
    body = stripe_body()
    event_id = json.loads(body)["id"]
    # Another session stores the same event and has not committed: the receiver's insert must wait.
    store_events(other, [IncomingEvent("stripe", event_id, "invoice.paid", {})])
    url = with_settings(servers.database_url, lock_timeout="200ms")
    with ReceiverProcess(url, schema) as receiver:
        status, reply = receiver.post("stripe", body, stripe_headers(body))
        assert (status, reply) == (503, {"error": "temporarily unavailable, retry later"}), (
            "a lock timeout is not the request's fault: the provider must retry"
        )
        other.rollback()
        assert receiver.post("stripe", body, stripe_headers(body)) == (200, {"accepted": 1, "duplicates": 0})
        assert receiver.terminate() == 0
    assert db.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (1,)


def status(db: Conn, event_id: str) -> object:
    row = db.execute("SELECT status FROM webhook_inbox WHERE event_id = %s", (event_id,)).fetchone()
    return row[0] if row else None


def store_one(db: Conn) -> str:
    event_id = f"evt_{uuid.uuid4().hex}"
    with db.transaction():
        store_events(db, [IncomingEvent("stripe", event_id, "invoice.paid", {})])
    return event_id


def test_a_handler_that_times_out_on_a_lock_is_retried_without_using_up_the_events_attempts(
    servers: Servers, schema: str, db: Conn, other: Conn
) -> None:
    db.execute(HOOKS_SCHEMA_SQL)
    event_id = store_one(db)
    other.execute("LOCK TABLE applied IN EXCLUSIVE MODE")  # the handler's insert must wait
    url = with_settings(servers.database_url, lock_timeout="200ms")
    with WorkerProcess(url, schema) as worker:
        # More lock timeouts than the app's max_attempts (3): before the fix the event ended failed.
        wait_until(
            lambda: worker.log().count("55P03") >= 4 or status(db, event_id) == "failed",
            60,
            what="the handler timing out on the lock",
        )
        other.rollback()
        wait_settled(db, 1)
        assert worker.process.poll() is None, "the worker must not die of it"
        assert worker.terminate() == 0
    row = db.execute(
        "SELECT status, attempts, last_error FROM webhook_inbox WHERE event_id = %s", (event_id,)
    )
    assert row.fetchone() == ("done", 1, None), "done, and only the attempt that went through counted"
    assert applied(db) == [(event_id, 1)]


def test_a_stuck_event_locked_by_another_session_neither_stops_the_reaper_nor_the_worker(
    servers: Servers, schema: str, db: Conn, other: Conn
) -> None:
    db.execute(HOOKS_SCHEMA_SQL)
    event_id = store_one(db)
    # As a worker that died mid-event leaves it, long past the visibility timeout.
    db.execute(
        "UPDATE webhook_inbox SET status = 'processing', attempts = 1, locked_at = now() - interval '1 hour'"
    )
    other.execute("SELECT 1 FROM webhook_inbox WHERE event_id = %s FOR UPDATE", (event_id,))
    fresh = store_one(db)
    url = with_settings(servers.database_url, lock_timeout="200ms")
    with WorkerProcess(url, schema) as worker:
        wait_until(
            lambda: worker.process.poll() is not None or applied(db) == [(fresh, 1)],
            30,
            what="the fresh event applied",
        )
        holds_for(  # four reaper passes (every 0.5 s) while the stuck row is locked
            lambda: worker.process.poll() is None, 2, what="the worker alive through four reaper passes"
        )
        other.rollback()
        wait_settled(db, 2)
        assert worker.terminate() == 0
    assert sorted(applied(db)) == sorted([(event_id, 1), (fresh, 1)])
    assert db.execute("SELECT attempts FROM webhook_inbox WHERE event_id = %s", (event_id,)).fetchone() == (
        2,
    )
