"""The inbox consumer inside a service's own process, on real Kafka and PostgreSQL: started in a thread of
its own and stopped from another, or run as an asyncio task and cancelled; neither touches the process's
signal handlers. And a message that arrives alone is handled at once: a batch is what has arrived, not
what the poll waits to fill."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import uuid

import psycopg

from postbox import consume_async, start_consumer
from tests.apps import async_bank
from tests.apps import bank as bank_service
from tests.support.kafka import create_topic, produce
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]


def _applied(db: Conn, message_id: str) -> bool:
    return db.execute("SELECT count(*) FROM effects WHERE message_id = %s", (message_id,)).fetchone() == (1,)


def _deposit(kind: str = "Deposit") -> tuple[str, str, dict[str, object]]:
    return (f"dep-{uuid.uuid4().hex}", kind, {"account": "acct", "amount": 5})


def test_a_consumer_started_in_a_thread_applies_messages_and_stops_when_asked(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"embedded-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    handlers_before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    running = start_consumer(
        bank_app(schema), servers.database_url, servers.kafka_bootstrap, [topic], group_id=f"g-{topic}"
    )
    try:
        wait_until(lambda: running.ready()[0], 45, what="ready")
        event = _deposit()
        produce(servers.kafka_bootstrap, topic, [event])
        wait_until(lambda: _applied(bank, event[0]), 30, what="applied")
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers_before
    finally:
        running.stop()
    assert running.join(timeout=30) == 0
    assert not running.running


def polling() -> bool:
    """Whether a consumer thread of this process (start_consumer's) is in its poll, InboxConsumer._arrived,
    where it waits for the first message to arrive."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if not thread.name.startswith("postbox-inbox-") or thread.ident is None:
            continue
        frame = frames.get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "_arrived":
                return True
            frame = frame.f_back
    return False


def bank_app(schema: str) -> bank_service.Inbox:
    """tests.apps.bank's Inbox, on the test's schema."""
    bank_service.inbox.schema = schema
    return bank_service.inbox


def test_a_message_that_arrives_alone_is_handled_without_waiting_for_the_batch_to_fill(
    servers: Servers, schema: str, bank: Conn
) -> None:
    """With a poll that would wait 60 s for 500 messages, one message is applied long before: the batch is
    what has arrived (before, the message waited for the poll's timeout)."""
    topic = f"embedded-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    running = start_consumer(
        bank_app(schema),
        servers.database_url,
        servers.kafka_bootstrap,
        [topic],
        group_id=f"g-{topic}",
        batch_size=500,
        poll_timeout=60.0,
    )
    try:
        wait_until(lambda: running.ready()[0], 45, what="ready")
        wait_until(polling, 20, what="the consumer inside its poll, waiting for the first message")
        event = _deposit()
        produce(servers.kafka_bootstrap, topic, [event])
        wait_until(lambda: _applied(bank, event[0]), 20, what="applied well before the poll's 60 s")
    finally:
        running.stop()
    assert running.join(timeout=90) == 0


def test_a_consumer_run_as_an_asyncio_task_applies_messages_and_stops_when_the_task_is_cancelled(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"embedded-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    async_bank.inbox.schema = schema
    event = _deposit("AsyncDeposit")  # an async handler, on the consumer thread's loop, not this one
    handlers_before = signal.getsignal(signal.SIGTERM)

    async def service() -> None:
        task = asyncio.create_task(
            consume_async(
                async_bank.inbox,
                servers.database_url,
                servers.kafka_bootstrap,
                [topic],
                group_id=f"g-{topic}",
            )
        )
        produce(servers.kafka_bootstrap, topic, [event])
        # Waited for on a thread of its own: this loop runs the task meanwhile.
        await asyncio.to_thread(
            wait_until, lambda: task.done() or _applied(bank, event[0]), 45, what="the deposit applied"
        )
        assert not task.done(), task
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("the cancelled task ended without CancelledError")

    asyncio.run(service())
    assert signal.getsignal(signal.SIGTERM) == handlers_before
    claimed = bank.execute("SELECT status FROM inbox_message WHERE message_id = %s", (event[0],)).fetchone()
    assert claimed == ("done",)
