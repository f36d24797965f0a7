"""Applying a batch in PostgreSQL: claim, handle, park, commit.

One transaction claims every message with one INSERT ... ON CONFLICT DO NOTHING RETURNING, runs the
handlers of the newly claimed messages, parks messages whose handler keeps failing (and sends them to the
dead-letter topic, inbox.dead_letters, before the commit), commits, then runs the after_commit hooks. The
handlers first run together under one savepoint; when one of them raises, that savepoint is rolled back and
they run again one by one, each under its own savepoint with its retries, so a failing handler undoes only
its own writes and never its neighbours'. No Kafka loop here: the consumer (inbox.consumer) hands batches
in, the requeue (inbox.requeue) single messages, the test harness (inbox.testing) messages it made.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import structlog
import tenacity

from postbox.inbox.calling import HandlerCaller
from postbox.inbox.handlers import PERMANENT, Inbox, Unhandled, decode_payload
from postbox.inbox.message import Message, MessageIdMissing, event_type_of
from postbox.inbox.metrics import InboxMetrics
from postbox.relay.core.db import describe_error, storable_text, transient_database_error
from postbox.relay.core.sql import query

if TYPE_CHECKING:
    from postbox.inbox.dead_letters import DeadLetters
    from postbox.inbox.tracing import BatchSpans

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.inbox")
# The wait before work a transient database error rolled back is tried again (a batch read again, a
# requeued message): jittered (two consumers that deadlocked do not meet again at once), doubling from
# this while it keeps happening, up to the cap.
TRANSIENT_BACKOFF = 0.1
TRANSIENT_BACKOFF_CAP = 10.0


@dataclass
class Work:
    message: Message
    claimed: bool = False
    missing_id: str | None = None  # why the id could not be read (parked under its coordinates)


def decode(record: Any, inbox: Inbox) -> Work:
    """A record as the handlers see it; a record whose id cannot be read keeps its coordinates and why."""
    headers = {name: value or b"" for name, value in (record.headers() or [])}
    topic, partition, offset = record.topic(), record.partition(), record.offset()
    missing = None
    try:
        message_id = inbox.id_source.extract(topic, partition, offset, headers, record.value())
    except MessageIdMissing as exc:
        # Never dropped: kept under its coordinates, parked with the reason.
        message_id, missing = f"{topic}/{partition}/{offset}", str(exc)
    _, timestamp = record.timestamp()
    message = Message(
        topic,
        partition,
        offset,
        record.key(),
        record.value(),
        headers,
        message_id,
        event_type_of(headers, inbox.event_type_header),
        timestamp,
    )
    return Work(message, missing_id=missing)


class Applier:
    """Applies batches of one Inbox; `spans` (tracing) and `dead_letters` are set by whoever runs it."""

    def __init__(self, inbox: Inbox, metrics: InboxMetrics, calls: HandlerCaller) -> None:
        self.inbox = inbox
        self.metrics = metrics
        self.calls = calls
        self.spans: BatchSpans | None = None  # the batch being applied, when tracing is on
        self.dead_letters: DeadLetters | None = None  # the Inbox's dead-letter topic, when it names one

    def apply(self, conn: psycopg.Connection[tuple[Any, ...]], work: list[Work]) -> None:
        """Claim `work` and apply what is new in one transaction on `conn`; then the after_commit hooks."""
        with conn.transaction():
            new_ids = self._claim(conn, work)
            for item in work:  # offset order; a repeat inside the batch runs once, at its first place
                if item.message.message_id in new_ids:
                    new_ids.discard(item.message.message_id)
                    item.claimed = True
                elif self.spans is not None:
                    self.spans.event(
                        item.message,
                        "postbox.duplicate",
                        reason=f"message id already claimed by consumer {self.inbox.consumer!r}",
                    )
            _count_by_topic(self.metrics.duplicates, (w.message for w in work if not w.claimed))
            failed = self._handle_all(conn, [item for item in work if item.claimed])
            if failed and self.dead_letters is not None:
                self.dead_letters.send(failed)  # before the commit: a failure here retries the batch
        claimed = [w.message for w in work if w.claimed]
        log.debug(
            "inbox_batch_applied",
            messages=len(work),
            claimed=len(claimed),
            duplicates=len(work) - len(claimed),
        )
        # The hooks are for what the batch applied: a parked message was claimed, never applied.
        parked = {id(message) for message, _ in failed}
        self.inbox.run_after_commit([m for m in claimed if id(m) not in parked], self.calls)

    def _claim_statement(self, conn: psycopg.Connection[tuple[Any, ...]], work: list[Work]) -> set[str]:
        rows = conn.execute(
            query(QUERIES, "claim_messages"),
            {
                "consumer": self.inbox.consumer,
                "ids": [w.message.message_id for w in work],
                "topics": [w.message.topic for w in work],
                "partitions": [w.message.partition for w in work],
                "offsets": [w.message.offset for w in work],
                "keys": [w.message.key for w in work],
            },
        ).fetchall()
        return {str(r[0]) for r in rows}

    def _claim(self, conn: psycopg.Connection[tuple[Any, ...]], work: list[Work]) -> set[str]:
        """Claim the batch in one statement; the message ids this transaction now owns.

        Ids are checked before they get here (inbox.message.usable_id), but should the database (or
        psycopg, which refuses NUL before sending) still refuse one record's data, that must not hold back
        the batch nor loop forever: the batch is claimed again one record at a time and each refused
        record is parked under its coordinates.

        Only a refusal of the data parks: a transient error (a deadlock with another consumer claiming
        the same ids, a lock timeout) fails the whole batch, which is read again (_read_again_later).
        Claimed one by one, the records go in message id order, the claim statement's own order, so the
        locks this transaction takes still follow one order."""
        try:
            with conn.transaction():  # a savepoint, so a refused claim leaves the transaction usable
                return self._claim_statement(conn, work)
        except psycopg.Error as exc:
            if transient_database_error(exc, conn):
                raise
            log.warning("inbox_claim_refused", error=describe_error(exc), messages=len(work))
        claimed: set[str] = set()
        for item in sorted(work, key=lambda w: w.message.message_id):
            try:
                with conn.transaction():
                    claimed |= self._claim_statement(conn, [item])
                continue
            except psycopg.Error as exc:
                if transient_database_error(exc, conn):
                    raise
                reason = f"refused by the database ({describe_error(exc)})"
            message = item.message
            item.message = replace(message, message_id=message.coordinates)
            item.missing_id = reason
            claimed |= self._claim_statement(conn, [item])
        return claimed

    def _handle_all(
        self, conn: psycopg.Connection[tuple[Any, ...]], items: list[Work]
    ) -> list[tuple[Message, str]]:
        """Run the claimed messages' handlers; returns the messages parked, with their reasons.

        The optimistic pass costs two round trips per batch instead of two per message (a savepoint and
        its release). When it fails, its writes are rolled back and every handler runs again on its own:
        a handler can therefore run twice for one delivery; as with retries, only its writes in `tx` count.
        """
        if items and all(item.missing_id is None for item in items):
            try:
                with conn.transaction():  # a savepoint: every handler of the batch
                    for item in items:
                        self._run_handler(conn, item.message)
            except Exception as exc:
                if transient_database_error(exc, conn):
                    raise  # the database went away, or lost a race: the whole batch is read again
                reason = f"{type(exc).__name__}: {describe_error(exc)}"
                log.debug("inbox_batch_pass_failed", error=reason)
                if self.spans is not None:
                    for item in items:
                        self.spans.event(item.message, "postbox.batch_pass_failed", reason=reason)
            else:
                _count_by_topic(self.metrics.processed, (item.message for item in items))
                return []
        failed: list[tuple[Message, str]] = []
        for item in items:
            outcome = self.handle(conn, item)
            if outcome is not None:
                failed.append((item.message, outcome))
        return failed

    def _run_handler(self, conn: psycopg.Connection[tuple[Any, ...]], message: Message) -> None:
        registered = self.inbox.handler_for(message)
        if registered is None:
            if self.inbox.unhandled == "park":
                raise Unhandled(message)
            log.debug("inbox_unhandled", topic=message.topic, event_type=message.event_type)
            return
        handler, payload_type = registered
        if payload_type is not None:
            message = decode_payload(message, payload_type)  # PayloadMismatch parks it, with why
        started = time.perf_counter()
        try:
            if self.spans is None:
                self.calls.with_transaction(handler, conn, message)
            else:
                with self.spans.current(message):  # the handler's own spans are its children
                    self.calls.with_transaction(handler, conn, message)
        finally:
            self.metrics.handler_seconds.observe(time.perf_counter() - started)

    def handle(self, conn: psycopg.Connection[tuple[Any, ...]], item: Work) -> str | None:
        """Run the message's handler with bounded retries; returns the reason when it ends parked."""
        message = item.message
        if item.missing_id is not None:
            return self._park(conn, message, f"message id: {item.missing_id}", 1)
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            with conn.transaction():  # a savepoint: this handler's writes only
                self._run_handler(conn, message)

        def retrying_after(state: tenacity.RetryCallState) -> None:
            self.metrics.retries.inc()
            exc = state.outcome.exception() if state.outcome else None
            if self.spans is not None:
                self.spans.event(message, "postbox.retry", attempt=state.attempt_number, error=_reason(exc))
            log.warning(
                "inbox_handler_retry",
                topic=message.topic,
                partition=message.partition,
                offset=message.offset,
                attempt=state.attempt_number,
                error=_reason(exc),
            )

        retrying = tenacity.Retrying(
            # A PermanentError parks at once. A transient database error is the whole batch's problem, not
            # this message's: the batch is read again. Retrying only this handler's savepoint would not
            # do: after a serialization failure the transaction's snapshot can never succeed, and after a
            # deadlock the batch's claims are still held by the transaction the other side waits for.
            retry=tenacity.retry_if_exception(
                lambda exc: not isinstance(exc, PERMANENT) and not transient_database_error(exc, conn)
            ),
            stop=tenacity.stop_after_attempt(self.inbox.max_attempts),
            wait=tenacity.wait_random_exponential(multiplier=self.inbox.retry_backoff, max=10),
            before_sleep=retrying_after,
            reraise=True,
        )
        try:
            retrying(attempt)
        except Exception as exc:
            # A handler that says PermanentError means it, whatever database error it was raised from.
            if not isinstance(exc, PERMANENT) and transient_database_error(exc, conn):
                raise
            reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, PERMANENT) else _reason(exc)
            return self._park(conn, message, reason, attempts, exc)
        self.metrics.processed.labels(message.topic).inc()
        return None

    def _park(
        self,
        conn: psycopg.Connection[tuple[Any, ...]],
        message: Message,
        reason: str,
        attempts: int,
        exc: BaseException | None = None,
    ) -> str:
        conn.execute(
            query(QUERIES, "mark_failed"),
            {
                "consumer": self.inbox.consumer,
                "error": storable_text(reason),
                "attempts": attempts,
                "message_id": message.message_id,
            },
        )
        self.metrics.failed.labels(message.topic).inc()
        if self.spans is not None:
            self.spans.parked(message, reason, attempts)
        log.error(
            "inbox_message_parked",
            topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            message_id=message.message_id,
            attempts=attempts,
            reason=reason,
            # The handler's traceback, where it failed: what a developer needs to fix it (its text, never
            # the frames' local variables, so no payload rides along).
            exc_info=exc,
        )
        return reason


def _count_by_topic(counter: Any, messages: Iterable[Message]) -> None:
    """One increment per topic for a batch (a labelled child's lookup per message costs more than the
    no-op handler it counts)."""
    for topic, count in collections.Counter(m.topic for m in messages).items():
        counter.labels(topic).inc(count)


def _reason(exc: BaseException | None) -> str:
    """A handler's failure as recorded with a parked message: class and primary message (no DETAIL)."""
    return f"{type(exc).__name__}: {describe_error(exc)}" if exc is not None else "unknown"
