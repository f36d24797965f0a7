"""Webhook workers: drain the webhook inbox with FOR UPDATE SKIP LOCKED.

A claim flips up to a batch of pending rows to 'processing' (and counts the attempt) in one statement and
commits. Each row then gets a transaction of its own in which the registered handler runs and the row is
marked done; a handler error rolls that work back and records the error, with backoff, until the attempts
cap ends the row as failed. A transient database error (a deadlock, a lock timeout, a serialization
failure: relay.core.db.transient_database_error) is not the event's fault: its work is rolled back and the
row goes back to pending after a jittered wait without spending an attempt, and anywhere else in the loop
such an error is retried after a wait; it never parks an event nor stops the worker. A worker that dies
mid-event leaves its row 'processing'; the reaper (every worker runs it) returns such rows after the
visibility timeout, and rows that keep killing their worker end failed once they have used their attempts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from postbox.inbox.calling import HandlerCaller, check_callable, check_no_running_loop, is_async
from postbox.inbox.handlers import PERMANENT
from postbox.inbox.webhooks.store import WebhookStatus
from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from postbox.relay.core.db import (
    DEFAULT_SCHEMA,
    connect,
    database_unavailable,
    describe_error,
    storable_text,
    transient_database_error,
)
from postbox.relay.core.sql import query

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.webhooks.worker")
# After a transient database error, for an event sent back to pending as for the worker's loop: a jittered
# wait that doubles from this scale while such errors follow each other, up to the cap (seconds).
TRANSIENT_BACKOFF = 0.1
TRANSIENT_BACKOFF_CAP = 10.0


@dataclass(frozen=True)
class WebhookEvent:
    provider: str
    event_id: str
    event_type: str
    payload: Any
    headers: dict[str, str]
    attempt: int
    received_at: datetime


# `def handler(tx, event)`, or `async def handler(tx, event)` awaited with an AsyncConnection in the same
# transaction (inbox.calling).
WebhookHandler = (
    Callable[[psycopg.Connection[Any], WebhookEvent], None]
    | Callable[[psycopg.AsyncConnection[Any], WebhookEvent], Awaitable[None]]
)
W = TypeVar("W", bound=WebhookHandler)


class Webhooks:
    """Handlers per provider and event type, e.g.

        hooks = Webhooks()

        @hooks.handler("stripe", "invoice.paid")
        def paid(tx, event): ...

    `hooks.handler("stripe", "*")` takes the provider's other types. An event with no handler is marked
    done (and logged), so an unneeded subscription does not pile up.
    """

    def __init__(
        self,
        max_attempts: int = 8,
        visibility_timeout: float = 300.0,
        retry_backoff: float = 1.0,
        schema: str = DEFAULT_SCHEMA,
    ) -> None:
        if not 1 <= max_attempts <= 100:
            raise ValueError(f"max-attempts: {max_attempts} is outside 1..100")
        self.max_attempts = max_attempts
        self.visibility_timeout = visibility_timeout
        self.retry_backoff = retry_backoff
        self.schema = schema
        self._handlers: dict[tuple[str, str], WebhookHandler] = {}

    def handler(self, provider: str, event_type: str) -> Callable[[W], W]:
        def register(function: W) -> W:
            check_callable(function, f"webhook handler for {provider} {event_type!r}", 2)
            if (provider, event_type) in self._handlers:
                raise ValueError(f"a handler for {provider} {event_type!r} is already registered")
            self._handlers[(provider, event_type)] = function
            return function

        return register

    def awaits(self) -> bool:
        """Whether any handler is async (the worker then needs a thread without an event loop)."""
        return any(is_async(f) for f in self._handlers.values())

    def handler_for(self, provider: str, event_type: str) -> WebhookHandler | None:
        return self._handlers.get((provider, event_type)) or self._handlers.get((provider, "*"))


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry or CollectorRegistry()
        self.events = Counter(
            "postbox_webhook_worker_events_total",
            "Webhook events a worker finished, by outcome",
            ["provider", "outcome"],
            registry=registry,
        )
        self.oldest_pending_seconds = Gauge(
            "postbox_webhook_oldest_pending_age_seconds",
            "Age of the oldest webhook event waiting for a worker",
            registry=registry,
        )
        self.reaped = Counter(
            "postbox_webhook_reaped_total", "Events returned by the reaper", registry=registry
        )


class WebhookWorker:
    def __init__(
        self,
        hooks: Webhooks,
        database_url: str,
        batch_size: int = 20,
        poll_interval: float = 0.5,
        reap_interval: float = 10.0,
        metrics: WorkerMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.hooks = hooks
        self._tracer = tracer
        self.metrics = metrics or WorkerMetrics()
        self.daemon = Daemon("webhook_worker")
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self.database_url = database_url
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.reap_interval = reap_interval
        self._next_reap = 0.0
        self._last_claim: float | None = None  # when the last claim statement succeeded
        self._transient_in_row = 0  # transient database errors since the last event done (the wait grows)
        self._calls = HandlerCaller()  # runs the handlers, def or async def, in this worker's thread

    def stop(self) -> None:
        self.daemon.stop()

    def healthy(self) -> tuple[bool, str]:
        return self.daemon.healthy()

    def ready(self) -> tuple[bool, str]:
        """Connected and claiming: a claim has succeeded since the last time the database was lost, and the
        loop turns (a worker that cannot reach the database takes no share of the work)."""
        if self._last_claim is None:
            return False, "not connected to PostgreSQL (no claim since the last connection loss)"
        healthy, reason = self.healthy()
        if not healthy:
            return False, reason
        return True, f"ok: last claim {time.monotonic() - self._last_claim:.1f}s ago"

    def install_signal_handlers(self) -> None:
        self.daemon.install_signal_handlers()

    def run(self) -> int:
        if self.hooks.awaits():
            check_no_running_loop()  # at start, not at the first event
        log.info("webhook_worker_started", batch_size=self.batch_size)
        try:
            self.daemon.run(
                self._turn, lost=lambda exc: database_unavailable(exc, self._conn), on_lost=self._on_lost
            )
        finally:
            self._close()
            self._calls.close()
        log.info("webhook_worker_stopped")
        return 0

    def _turn(self) -> None:
        if self._conn is None:
            self._conn = connect(self.database_url, self.hooks.schema, application_name="postbox-webhooks")
        conn = self._conn
        try:
            self._maybe_reap(conn)
            claimed = self.run_once(conn)
        except Exception as exc:
            # A lost database is the daemon's to handle (reconnect); anything that is not a database's
            # transient error is a bug and stops the worker.
            if database_unavailable(exc, conn) or not transient_database_error(exc):
                raise
            self._wait_after_transient(conn, exc)
            return
        if claimed < self.batch_size:
            self.daemon.sleep(self.poll_interval)

    def _transient_delay(self) -> float:
        self._transient_in_row += 1
        return backoff_delay(self._transient_in_row, base=TRANSIENT_BACKOFF, cap=TRANSIENT_BACKOFF_CAP)

    def _wait_after_transient(self, conn: psycopg.Connection[tuple[Any, ...]], exc: BaseException) -> None:
        """A statement of the loop (the reaper, a claim, an event's mark) lost a race: its transaction was
        rolled back. Events this worker had claimed and not finished stay 'processing' and come back
        through the reaper, as after a crash."""
        conn.rollback()  # the reaper's gauge query runs outside conn.transaction(): end it, if open
        delay = self._transient_delay()
        log.warning("webhook_worker_retry", error=describe_error(exc), retry_in=round(delay, 3))
        self.daemon.sleep(delay)

    def _on_lost(self, _exc: BaseException) -> None:
        self._last_claim = None  # unready until a claim goes through again
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _maybe_reap(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        if time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + self.reap_interval
        with conn.transaction():
            rows = conn.execute(
                query(QUERIES, "reap_stuck"),
                {
                    "visibility": timedelta(seconds=self.hooks.visibility_timeout),
                    "max_attempts": self.hooks.max_attempts,
                },
            ).fetchall()
        for provider, event_id, status in rows:
            self.metrics.reaped.inc()
            log.warning("webhook_event_reaped", provider=provider, event_id=event_id, now=status)
        oldest = conn.execute(query(QUERIES, "oldest_pending_age")).fetchone()
        conn.commit()
        self.metrics.oldest_pending_seconds.set(float(oldest[0]) if oldest else 0.0)

    def run_once(self, conn: psycopg.Connection[tuple[Any, ...]]) -> int:
        """Claim a batch and process each event; returns how many were claimed."""
        with conn.transaction():
            claimed = [
                WebhookEvent(*row)
                for row in conn.execute(query(QUERIES, "claim_events"), {"limit": self.batch_size}).fetchall()
            ]
        self._last_claim = time.monotonic()
        for event in claimed:
            if self.daemon.stopping:
                break  # the rest stay 'processing' and come back through the reaper; none is lost
            self._process(conn, event)
        return len(claimed)

    def _process(self, conn: psycopg.Connection[tuple[Any, ...]], event: WebhookEvent) -> None:
        if self._tracer is None:
            self._settle(conn, event)
            return
        from postbox.inbox.tracing import webhook_processing  # noqa: PLC0415  (OpenTelemetry is optional)

        with webhook_processing(
            self._tracer, event.provider, event.event_id, event.event_type, event.attempt, event.headers
        ) as span:
            outcome, reason = self._settle(conn, event)
            span.outcome(outcome, reason)

    def _settle(
        self, conn: psycopg.Connection[tuple[Any, ...]], event: WebhookEvent
    ) -> tuple[str, str | None]:
        """Run the event's handler and mark it; (outcome, reason): done, unhandled, fenced, retry or
        failed (parked), as counted in postbox_webhook_worker_events_total."""
        key = {"provider": event.provider, "event_id": event.event_id, "attempts": event.attempt}
        handler = self.hooks.handler_for(event.provider, event.event_type)
        try:
            with conn.transaction():
                if handler is None:
                    log.info("webhook_event_unhandled", provider=event.provider, event_type=event.event_type)
                else:
                    self._calls.with_transaction(handler, conn, event)
                if conn.execute(query(QUERIES, "mark_done"), key).rowcount != 1:
                    # The reaper gave this row to another worker meanwhile: undo ours, theirs stands.
                    raise _Fenced
        except _Fenced:
            self.metrics.events.labels(event.provider, "fenced").inc()
            log.warning("webhook_event_fenced", provider=event.provider, event_id=event.event_id)
            return "fenced", "the reaper gave the event to another worker; this attempt was rolled back"
        except Exception as exc:
            permanent = isinstance(exc, PERMANENT)
            # A handler that says PermanentError means it, whatever database error it was raised from.
            if not permanent and transient_database_error(exc, conn):
                if database_unavailable(exc, conn):
                    raise  # the daemon reconnects; the row comes back through the reaper
                return self._release(conn, event, exc)
            reason = storable_text(f"{type(exc).__name__}: {describe_error(exc)}")
            with conn.transaction():
                row = conn.execute(
                    query(QUERIES, "mark_failed_attempt"),
                    {
                        **key,
                        "permanent": permanent,
                        "error": reason,
                        "max_attempts": self.hooks.max_attempts,
                        "retry_in": timedelta(
                            seconds=backoff_delay(event.attempt, base=self.hooks.retry_backoff, cap=300)
                        ),
                    },
                ).fetchone()
            status = row[0] if row else "fenced"
            outcome = "failed" if status == WebhookStatus.FAILED else "retry"
            self.metrics.events.labels(event.provider, outcome).inc()
            log.warning(
                "webhook_event_failed",
                provider=event.provider,
                event_id=event.event_id,
                event_type=event.event_type,
                attempt=event.attempt,
                now=status,
                error=reason,
                exc_info=exc,  # the handler's traceback (its text only: no local variables, no payload)
            )
            return outcome, reason
        self._transient_in_row = 0
        self.metrics.events.labels(event.provider, "done").inc()
        log.debug("webhook_event_done", provider=event.provider, event_id=event.event_id)
        return ("done", None) if handler is not None else ("unhandled", "no handler for this event type")

    def _release(
        self, conn: psycopg.Connection[tuple[Any, ...]], event: WebhookEvent, exc: BaseException
    ) -> tuple[str, str | None]:
        """The event's transaction was rolled back by a transient database error, which is not the
        event's fault: back to pending after a jittered wait, without spending an attempt (counted as a
        retry). A failure of this statement itself goes to the loop (_turn)."""
        reason = storable_text(f"{type(exc).__name__}: {describe_error(exc)}")
        delay = self._transient_delay()
        with conn.transaction():
            row = conn.execute(
                query(QUERIES, "release_transient"),
                {
                    "provider": event.provider,
                    "event_id": event.event_id,
                    "attempts": event.attempt,
                    "error": reason,
                    "retry_in": timedelta(seconds=delay),
                },
            ).fetchone()
        self.metrics.events.labels(event.provider, "retry").inc()
        log.warning(
            "webhook_event_released",
            provider=event.provider,
            event_id=event.event_id,
            event_type=event.event_type,
            attempt=event.attempt,
            now=row[0] if row else "fenced",
            retry_in=round(delay, 3),
            error=reason,
        )
        return "retry", reason


class _Fenced(Exception):
    pass
