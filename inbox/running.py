"""Running the inbox consumer inside a service: in the calling thread, in a thread of its own, or as an
asyncio task. The `postbox inbox consume` command is the first of these, in a process of its own.

    from postbox import consume, start_consumer, consume_async

    consume(inbox, database_url, bootstrap, ["outbox.event.order"])            # blocks until SIGTERM/SIGINT
    running = start_consumer(inbox, database_url, bootstrap, topics)            # returns at once
    running.stop(); running.join()                                              # from any thread
    task = asyncio.create_task(consume_async(inbox, database_url, bootstrap, topics))
    task.cancel()                                                               # stops it cleanly

Signal handlers are the process's: `consume` installs them (SIGTERM and SIGINT stop it) only when it runs
on the main thread, which is when it owns the process; a consumer started in a thread or as a task never
touches them, and stops when asked. Traces as `postbox inbox consume` does when the OTEL_* variables ask
for it (relay.core.tracing), into the application's own tracer provider when it has installed one.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import structlog

from postbox.inbox.consumer import ConsumerSettings, InboxConsumer
from postbox.inbox.handlers import Inbox
from postbox.relay.core.tracing import Tracing, start_tracing_for

log = structlog.get_logger("postbox.inbox")


def _settings(
    database_url: str, kafka_bootstrap: str, topics: list[str], options: dict[str, Any]
) -> ConsumerSettings:
    """ConsumerSettings fields (group_id, batch_size, max_batch_bytes, kafka_config...) from `options`."""
    return ConsumerSettings(
        database_url=database_url, kafka_bootstrap=kafka_bootstrap, topics=topics, **options
    )


def consume(inbox: Inbox, database_url: str, kafka_bootstrap: str, topics: list[str], **options: Any) -> int:
    """Run `inbox` as a consumer in this thread until stopped; 0 after a clean stop. On the main thread
    SIGTERM and SIGINT stop it; elsewhere use start_consumer (or consume_async) to have a handle to stop."""
    settings = _settings(database_url, kafka_bootstrap, topics, options)
    with start_tracing_for("inbox", os.environ) as tracing:
        consumer = InboxConsumer(inbox, settings, tracer=tracing.tracer)
        if threading.current_thread() is threading.main_thread():
            consumer.install_signal_handlers()
        return consumer.run()


class RunningConsumer:
    """A consumer running in a thread of its own (start_consumer)."""

    def __init__(self, consumer: InboxConsumer, tracing: Tracing) -> None:
        self.consumer = consumer
        self._tracing = tracing
        self._result: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"postbox-inbox-{consumer.inbox.consumer}")

    def _run(self) -> None:
        try:
            self._result = self.consumer.run()
        except BaseException as exc:
            log.error("inbox_consumer_failed", consumer=self.consumer.inbox.consumer, exc_info=exc)
            self._error = exc
        finally:
            self._tracing.shutdown()  # exports what is queued

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask it to finish the batch in hand and stop (from any thread, a signal handler included)."""
        self.consumer.stop()

    def join(self, timeout: float | None = None) -> int:
        """Wait for it to end: 0 after a clean stop; the consumer's own error, raised here, if it failed.
        TimeoutError if it is still running after `timeout` seconds."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the inbox consumer {self.consumer.inbox.consumer!r} is still running")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def ready(self) -> tuple[bool, str]:
        """As /readyz: connected to PostgreSQL and a member of the consumer group (and why not)."""
        return self.consumer.ready()


def start_consumer(
    inbox: Inbox, database_url: str, kafka_bootstrap: str, topics: list[str], **options: Any
) -> RunningConsumer:
    """Start `inbox` as a consumer in a thread of its own and return at once. Settings are checked here
    (a bad one raises before anything starts); `stop()` and `join()` end it."""
    settings = _settings(database_url, kafka_bootstrap, topics, options)
    tracing = start_tracing_for("inbox", os.environ)
    running = RunningConsumer(InboxConsumer(inbox, settings, tracer=tracing.tracer), tracing)
    running.start()
    return running


async def consume_async(
    inbox: Inbox, database_url: str, kafka_bootstrap: str, topics: list[str], **options: Any
) -> int:
    """Run `inbox` as a consumer while this task runs: its own thread does the work (async handlers are
    awaited on that thread's event loop, not this one). Cancelling the task stops the consumer cleanly
    (the batch in hand finishes, offsets are committed) before the cancellation goes on."""
    running = start_consumer(inbox, database_url, kafka_bootstrap, topics, **options)
    try:
        return await asyncio.shield(asyncio.to_thread(running.join))
    except asyncio.CancelledError:
        running.stop()
        await asyncio.to_thread(running.join)
        raise
