"""The Kafka inbox consumer: claim, apply, commit, then commit offsets.

For each poll: one transaction claims every message with one INSERT ... ON CONFLICT DO NOTHING RETURNING,
runs the handlers of the newly claimed messages, parks messages whose handler keeps failing, commits; only
then are the offsets committed. The handlers first run together under one savepoint; when one of them
raises, that savepoint is rolled back and they run again one by one, each under its own savepoint with its
retries, so a failing handler undoes only its own writes and never its neighbours'.

What a crash at each step leaves behind: before the commit, nothing (the batch is read again); after the
commit and before the offset commit, the claims are durable, so the re-read batch is all duplicates and
changes nothing.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
import structlog
import tenacity
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from postbox.inbox.calling import HandlerCaller, check_no_running_loop
from postbox.inbox.handlers import PERMANENT, Inbox, Unhandled, decode_payload
from postbox.inbox.message import Message, MessageIdMissing, event_type_of
from postbox.inbox.metrics import InboxMetrics
from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from postbox.relay.core.db import (
    connect,
    database_unavailable,
    describe_error,
    storable_text,
    transient_database_error,
)
from postbox.relay.core.kafka_config import with_structlog_logger
from postbox.relay.core.settings import (
    Settings,
    SettingsError,
    setting,
    shared_database_url,
    shared_kafka_bootstrap,
    shared_kafka_config,
)
from postbox.relay.core.sql import query

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from postbox.inbox.tracing import BatchSpans

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.inbox")
LAG_INTERVAL = 15.0
# Readiness is checked, not assumed from traffic: every this many seconds the turn runs `SELECT 1` and,
# while all brokers were reported down, asks the cluster for metadata.
PROBE_INTERVAL = 5.0
# A consumer out of its group this long while the brokers answer has been left without an assignment
# (seen after broker faults: revoked, then never assigned again): it is renewed, as for #5586 below.
REJOIN_LIMIT = 60.0
# The wait before a batch rolled back by a transient database error is read again: jittered (two consumers
# that deadlocked do not meet again at once), doubling from this while it keeps happening, up to the cap.
TRANSIENT_BACKOFF = 0.1
TRANSIENT_BACKOFF_CAP = 10.0
# A requeue runs each parked message in a transaction of its own: this many tries of it when they keep
# meeting transient database errors, then the message is left parked as it was and reported.
REQUEUE_TRIES = 5
# Request-level errors of the offset fetch after an assignment. librdkafka (2.16) leaves the partitions it
# asked about waiting for that fetch forever (never fetched, never retried: confluentinc/librdkafka#5586),
# while the consumer looks healthy. A new consumer (a new assignment) recovers at once from the committed
# offsets.
_STUCK_OFFSET_FETCH = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
}


def leaves_assignment_stuck(error: KafkaError) -> bool:
    """A consume error after which the assigned partitions are never fetched (see _STUCK_OFFSET_FETCH)."""
    return error.code() in _STUCK_OFFSET_FETCH and "fetch committed offsets" in error.str()


def _topics(value: str) -> list[str]:
    return [topic.strip() for topic in value.split(",") if topic.strip()]


@dataclass(frozen=True, kw_only=True)
class ConsumerSettings(Settings):
    """An inbox consumer's settings (`postbox inbox consume`, or `inbox.consume(...)` from code)."""

    PREFIX: ClassVar[str] = "POSTBOX_INBOX_"
    SERVICE: ClassVar[str] = "inbox"

    database_url: str = shared_database_url()
    kafka_bootstrap: str = shared_kafka_bootstrap()
    kafka_config: dict[str, str] = shared_kafka_config()
    topics: list[str] = setting(None, "comma-separated topics to consume", parse=_topics, factory=list)
    group_id: str | None = setting(None, "Kafka consumer group", parse=str, shown_default="the inbox's name")
    batch_size: int = setting(
        500,
        "most messages per transaction (a batch is what has arrived, up to this many)",
        bounds=(1, 10_000),
        retired=("POSTBOX_BATCH_SIZE",),
    )
    # Memory: librdkafka prefetches into a local queue (64 MiB by default) and a poll takes its batch from
    # there; both the queue and each fetch are held to this many bytes, so a batch of large records
    # stays within about twice it, whatever the topic holds.
    max_batch_bytes: int = setting(
        16 << 20,
        "bytes of messages fetched ahead and held at once (librdkafka's fetch and local queue sizes)",
        bounds=(1 << 20, 1 << 30),
    )
    poll_timeout: float = 1.0  # how long a poll waits when nothing has arrived (the loop's heartbeat)

    def check(self) -> None:
        for key in ("enable.auto.commit", "enable.auto.offset.store"):
            if key in self.kafka_config:
                raise SettingsError(
                    f"kafka-config {key}: postbox stores each batch's offsets after its database commit "
                    "and has librdkafka commit what is stored; it cannot be set"
                )


@dataclass
class _Work:
    message: Message
    claimed: bool = False
    missing_id: str | None = None  # why the id could not be read (parked under its coordinates)


class InboxConsumer:
    def __init__(
        self,
        inbox: Inbox,
        settings: ConsumerSettings,
        metrics: InboxMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.inbox = inbox
        self.settings = settings
        self.metrics = metrics or InboxMetrics()
        self._tracer = tracer
        self._spans: BatchSpans | None = None  # the batch being applied, when tracing is on
        self.daemon = Daemon("inbox")
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self._dead_letters: Producer | None = None
        self._in_flight: list[Any] = []  # the batch being applied, read again after a database loss
        self._transient_in_row = 0  # batches in a row rolled back by a transient database error
        self._next_lag = 0.0
        self._consumer: Consumer | None = None
        self._stuck: str | None = None  # why the assignment must be taken afresh (a new consumer)
        # Readiness, each a reason while not ready, None when fine (ready() reads them from the metrics
        # server's thread): the database connection, the group membership, the brokers.
        self._database_problem: str | None = "not connected to PostgreSQL yet"
        self._group_problem: str | None = None
        self._out_of_group_since = time.monotonic()
        self._brokers_problem: str | None = None
        self._next_probe = 0.0
        self._calls = HandlerCaller()  # runs the handlers, def or async def, in this consumer's thread

    def stop(self) -> None:
        self.daemon.stop()

    def healthy(self) -> tuple[bool, str]:
        return self.daemon.healthy()

    def ready(self) -> tuple[bool, str]:
        """Connected to PostgreSQL and a member of the consumer group, whether or not messages arrive."""
        healthy, reason = self.healthy()
        if not healthy:
            return False, reason
        for problem in (self._database_problem, self._brokers_problem, self._group_problem):
            if problem is not None:
                return False, problem
        group = self.settings.group_id or self.inbox.consumer
        return True, f"ok: connected to PostgreSQL, a member of consumer group {group!r}"

    def install_signal_handlers(self) -> None:
        self.daemon.install_signal_handlers()

    def _kafka_consumer(self) -> Consumer:
        config: dict[str, Any] = {
            "bootstrap.servers": self.settings.kafka_bootstrap,
            "group.id": self.settings.group_id or self.inbox.consumer,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "queued.max.messages.kbytes": self.settings.max_batch_bytes // 1024,
            "fetch.max.bytes": self.settings.max_batch_bytes,
            **self.settings.kafka_config,
            # Offsets are stored only after the batch's database commit (_store_offsets) and committed
            # from there by librdkafka in the background, on a rebalance and at close: no broker round
            # trip per batch. A crash loses at most the last second's commits, and what is re-read then
            # is claimed already, so it is skipped as duplicates.
            "enable.auto.offset.store": False,
            "enable.auto.commit": True,
            "auto.commit.interval.ms": 1000,
        }
        return Consumer(with_structlog_logger(config))

    def run(self) -> int:
        if not self.settings.topics:  # checked here: a requeue needs no topics
            raise ValueError("topics: at least one topic is required (POSTBOX_INBOX_TOPICS)")
        if self.inbox.awaits():
            check_no_running_loop()  # at start, not at the first message
        if self.inbox.dead_letter_topic:
            self._dead_letters = Producer(
                with_structlog_logger(
                    {
                        "bootstrap.servers": self.settings.kafka_bootstrap,
                        "enable.idempotence": True,
                        "acks": "all",
                        **self.settings.kafka_config,
                    }
                )
            )

        self._consumer = self._subscribed()
        log.info("inbox_started", consumer=self.inbox.consumer, topics=self.settings.topics)

        def on_lost(exc: BaseException) -> None:
            self._database_problem = f"lost PostgreSQL ({describe_error(exc)}); reconnecting"
            self._close_db()
            assert self._consumer is not None
            self._rewind(self._consumer, self._in_flight)  # nothing of it was committed: read it again
            self._in_flight = []

        try:
            self.daemon.run(
                self._turn,
                lost=lambda exc: database_unavailable(exc, self._conn),
                on_lost=on_lost,
            )
        finally:
            self._consumer.close()
            if self._dead_letters is not None:
                self._dead_letters.flush(10)
            self._close_db()
            self._calls.close()
        log.info("inbox_stopped", consumer=self.inbox.consumer)
        return 0

    def _subscribed(self) -> Consumer:
        group = self.settings.group_id or self.inbox.consumer

        def on_revoke(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            # Batches are applied and committed between polls, so nothing is in flight here.
            log.info("inbox_partitions_revoked", partitions=[f"{p.topic}/{p.partition}" for p in partitions])
            # Until the rebalance assigns again (seconds): should it never do so, the probe renews us.
            self._out_of_group(f"rebalancing consumer group {group!r}: waiting for an assignment")

        def on_lost(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            # The group moved on without us (no heartbeat within session.timeout.ms): not a member until
            # the rejoin assigns us again.
            log.warning("inbox_partitions_lost", partitions=[f"{p.topic}/{p.partition}" for p in partitions])
            self._out_of_group(f"lost its membership of consumer group {group!r}; rejoining")

        def on_assign(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            log.info("inbox_partitions_assigned", partitions=[f"{p.topic}/{p.partition}" for p in partitions])
            self._group_problem = None  # a member, with these partitions (maybe none: more members than them)

        self._out_of_group(f"joining consumer group {group!r}")
        consumer = self._kafka_consumer()
        consumer.subscribe(self.settings.topics, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)
        return consumer

    def _out_of_group(self, reason: str) -> None:
        self._group_problem = reason
        self._out_of_group_since = time.monotonic()

    def _probe(self, consumer: Consumer) -> None:
        """Readiness from the servers themselves, whether or not messages arrive: the database answers (a
        loss raises, and the daemon reconnects), and brokers reported down answer again."""
        conn = self._db()
        with conn.transaction():
            conn.execute("SELECT 1")
        self._database_problem = None
        if self._brokers_problem is not None:
            try:
                consumer.list_topics(timeout=min(2.0, PROBE_INTERVAL))
            except KafkaException:
                pass
            else:
                self._brokers_problem = None
        if self._group_problem is not None and consumer.assignment():
            self._group_problem = (
                None  # partitions held: a member (a cooperative rebalance revokes only some)
            )
        out_for = time.monotonic() - self._out_of_group_since
        if self._group_problem is not None and self._brokers_problem is None and out_for > REJOIN_LIMIT:
            self._stuck = f"{self._group_problem}: no assignment for {out_for:.0f}s while the brokers answer"

    def _turn(self) -> None:
        """One poll: claim and apply the batch in one transaction, then commit its offsets."""
        assert self._consumer is not None
        if self._stuck is not None:
            # Between batches, so nothing is in flight: closing commits the stored offsets and leaves the
            # group; the new consumer's assignment starts from them.
            log.warning("inbox_consumer_renewed", reason=self._stuck)
            self._stuck = None
            self._consumer.close()
            self._consumer = self._subscribed()
        consumer = self._consumer
        if time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + PROBE_INTERVAL
            self._probe(consumer)
        if time.monotonic() >= self._next_lag:
            self._next_lag = time.monotonic() + LAG_INTERVAL
            self._record_lag(consumer)
            if self._dead_letters is not None:
                # Serves its log lines (kafka_client_log) while idle too: delivered only on poll.
                self._dead_letters.poll(0)
        records = self._arrived(consumer)
        self._in_flight = [r for r in records if self._usable(r)]
        if self._in_flight:
            try:
                self._apply(self._in_flight)
            except Exception as exc:
                # A lost database is the daemon's to handle (reconnect, then read the batch again);
                # anything that is not a database's transient error is a bug and stops the consumer.
                if database_unavailable(exc, self._conn) or not transient_database_error(exc):
                    raise
                self._read_again_later(consumer, exc)
                return
            self._transient_in_row = 0
            self._store_offsets(consumer, self._in_flight)
        self._in_flight = []

    def _arrived(self, consumer: Consumer) -> list[Any]:
        """The next batch: what has arrived, up to batch_size. Only an empty queue is waited on, and only
        for its first message: `consume(n, timeout)` alone would hold the first message back until n had
        arrived or the timeout passed (half a second of latency at low traffic)."""
        size = self.settings.batch_size
        records: list[Any] = consumer.consume(size, 0)
        if records:
            return records
        records = consumer.consume(1, self.settings.poll_timeout)
        if records and size > 1:
            records += consumer.consume(size - 1, 0)  # what came with it
        return records

    def _read_again_later(self, consumer: Consumer, exc: BaseException) -> None:
        """The batch's transaction was rolled back by a transient database error: a deadlock with another
        consumer, a lock timeout, a serialization failure. Nothing of it was committed and none of its
        messages is at fault, so none is parked: the batch is read again after a jittered wait, longer
        while it keeps happening. The wait is inside the turn and the next turn polls, so the consumer
        keeps its place in the group (max.poll.interval.ms) and its heartbeat."""
        self._transient_in_row += 1
        delay = backoff_delay(self._transient_in_row, base=TRANSIENT_BACKOFF, cap=TRANSIENT_BACKOFF_CAP)
        log.warning(
            "inbox_batch_retry",
            error=describe_error(exc),
            messages=len(self._in_flight),
            in_a_row=self._transient_in_row,
            retry_in=round(delay, 3),
        )
        self._rewind(consumer, self._in_flight)
        self._in_flight = []
        self.daemon.sleep(delay)

    def _record_lag(self, consumer: Consumer) -> None:
        """Messages between our position and each assigned partition's end (a consumer-lag gauge)."""
        try:
            for position in consumer.position(consumer.assignment()):
                if position.offset < 0:
                    continue  # nothing consumed yet on this partition
                # The high watermark the last fetch response carried: no broker round trip in the loop.
                _, high = consumer.get_watermark_offsets(position, cached=True)
                if high < 0:
                    continue  # not fetched from yet
                self.metrics.lag.labels(position.topic, str(position.partition)).set(
                    max(0, high - position.offset)
                )
        except KafkaException as exc:
            log.warning("inbox_lag_unavailable", error=str(exc))

    def _usable(self, record: Any) -> bool:
        error = record.error()
        if error is None:
            return True
        if error.code() == KafkaError._PARTITION_EOF:
            return False
        if error.fatal():
            raise KafkaException(error)
        log.warning("inbox_consume_error", error=error.str())
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._brokers_problem = f"no Kafka broker reachable ({error.str()})"
        if leaves_assignment_stuck(error):
            self._stuck = error.str()
        return False

    def _db(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._conn is None:
            self._conn = connect(
                self.settings.database_url,
                self.inbox.schema,
                application_name=f"postbox-inbox {self.inbox.consumer}"[:63],
            )
            self._database_problem = None
        return self._conn

    def close(self) -> None:
        """Release what apply_messages or requeue left open (run() releases its own)."""
        self._close_db()
        self._calls.close()

    def _close_db(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _decode(self, record: Any) -> _Work:
        headers = {name: value or b"" for name, value in (record.headers() or [])}
        topic, partition, offset = record.topic(), record.partition(), record.offset()
        missing = None
        try:
            message_id = self.inbox.id_source.extract(topic, partition, offset, headers, record.value())
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
            event_type_of(headers, self.inbox.event_type_header),
            timestamp,
        )
        return _Work(message, missing_id=missing)

    def _apply(self, records: list[Any]) -> None:
        work = [self._decode(r) for r in records]
        if self._tracer is None:
            self._apply_work(work)
            return
        from postbox.inbox.tracing import BatchSpans  # noqa: PLC0415  (OpenTelemetry is optional)

        group = self.settings.group_id or self.inbox.consumer
        self._spans = BatchSpans(self._tracer, [w.message for w in work], group, self.inbox.consumer)
        try:
            self._apply_work(work)
        except BaseException as exc:
            self._spans.end(exc)
            raise
        else:
            self._spans.end()
        finally:
            self._spans = None

    def apply_messages(self, messages: list[Message]) -> None:
        """Apply messages handed over directly, exactly as a batch read from Kafka is applied (claim,
        handlers, parking, commit, after_commit hooks); the test harness (inbox.testing) uses it."""
        self._apply_work([_Work(message) for message in messages])

    def _apply_work(self, work: list[_Work]) -> None:
        conn = self._db()
        with conn.transaction():
            new_ids = self._claim(conn, work)
            for item in work:  # offset order; a repeat inside the batch runs once, at its first place
                if item.message.message_id in new_ids:
                    new_ids.discard(item.message.message_id)
                    item.claimed = True
                elif self._spans is not None:
                    self._spans.event(
                        item.message,
                        "postbox.duplicate",
                        reason=f"message id already claimed by consumer {self.inbox.consumer!r}",
                    )
            _count_by_topic(self.metrics.duplicates, (w.message for w in work if not w.claimed))
            failed = self._handle_all(conn, [item for item in work if item.claimed])
            if failed and self._dead_letters is not None:
                self._send_dead_letters(failed)  # before the commit: a failure here retries the batch
        claimed = [w.message for w in work if w.claimed]
        log.debug(
            "inbox_batch_applied",
            messages=len(work),
            claimed=len(claimed),
            duplicates=len(work) - len(claimed),
        )
        # The hooks are for what the batch applied: a parked message was claimed, never applied.
        parked = {id(message) for message, _ in failed}
        self.inbox.run_after_commit([m for m in claimed if id(m) not in parked], self._calls)

    def _claim_statement(self, conn: psycopg.Connection[tuple[Any, ...]], work: list[_Work]) -> set[str]:
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

    def _claim(self, conn: psycopg.Connection[tuple[Any, ...]], work: list[_Work]) -> set[str]:
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
        self, conn: psycopg.Connection[tuple[Any, ...]], items: list[_Work]
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
                if self._spans is not None:
                    for item in items:
                        self._spans.event(item.message, "postbox.batch_pass_failed", reason=reason)
            else:
                _count_by_topic(self.metrics.processed, (item.message for item in items))
                return []
        failed: list[tuple[Message, str]] = []
        for item in items:
            outcome = self._handle(conn, item)
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
            if self._spans is None:
                self._calls.with_transaction(handler, conn, message)
            else:
                with self._spans.current(message):  # the handler's own spans are its children
                    self._calls.with_transaction(handler, conn, message)
        finally:
            self.metrics.handler_seconds.observe(time.perf_counter() - started)

    def _handle(self, conn: psycopg.Connection[tuple[Any, ...]], item: _Work) -> str | None:
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
            if self._spans is not None:
                self._spans.event(message, "postbox.retry", attempt=state.attempt_number, error=_reason(exc))
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
        if self._spans is not None:
            self._spans.parked(message, reason, attempts)
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

    def _send_dead_letters(self, failed: list[tuple[Message, str]]) -> None:
        producer, topic = self._dead_letters, self.inbox.dead_letter_topic
        assert producer is not None
        assert topic is not None
        errors: list[str] = []

        def on_delivery(error: KafkaError | None, _record: object) -> None:
            if error is not None:
                errors.append(error.str())

        for message, reason in failed:
            headers: list[tuple[str, str | bytes | None]] = [
                *message.headers.items(),
                ("postbox.error", reason.encode()),
                ("postbox.source", message.coordinates.encode()),
            ]
            producer.produce(topic, message.value, message.key, headers=headers, on_delivery=on_delivery)
        remaining = producer.flush(30)
        if remaining or errors:
            raise KafkaException(
                KafkaError(KafkaError._MSG_TIMED_OUT, f"dead-letter produce failed: {errors}")
            )

    def requeue(self, *, ids: list[str] | None = None, error_like: str | None = None) -> Requeued:
        """Parked messages of the consumer's inbox read again from Kafka by their coordinates and run through
        their handlers (with the usual retries), each in a transaction of its own that also marks it done.

        A message parked because its id was unusable stays parked: without an id it cannot be applied once.
        The running consumers never touch these messages again (their offsets are past them), and the rows
        are locked while this runs, so nothing is applied twice."""
        applied: list[str] = []
        again: list[tuple[str, str]] = []
        gone: list[str] = []
        conn = self._db()
        fetcher = Consumer(
            with_structlog_logger(
                {
                    "bootstrap.servers": self.settings.kafka_bootstrap,
                    "group.id": f"postbox-requeue-{self.inbox.consumer}",
                    "enable.auto.commit": False,
                    "auto.offset.reset": "error",
                    "isolation.level": "read_committed",
                    **self.settings.kafka_config,
                }
            )
        )
        try:
            with conn.transaction():
                parked = conn.execute(
                    query(QUERIES, "parked_to_requeue"),
                    {"consumer": self.inbox.consumer, "ids": ids, "error_like": error_like},
                ).fetchall()
            for message_id, topic, partition, offset in parked:
                record = _fetch(fetcher, str(topic), int(partition), int(offset))
                if record is None:
                    gone.append(str(message_id))
                    continue
                done, reason = self._requeue_retrying(conn, str(message_id), record)
                if done:
                    applied.append(str(message_id))
                elif reason is not None:
                    again.append((str(message_id), reason))
        finally:
            fetcher.close()
            self._close_db()
            self._calls.close()
        return Requeued(applied, again, gone)

    def _requeue_retrying(
        self, conn: psycopg.Connection[tuple[Any, ...]], message_id: str, record: Any
    ) -> tuple[bool, str | None]:
        """_requeue_one, tried again when a transient database error rolls its transaction back (the
        message is not at fault); after REQUEUE_TRIES such errors it is left parked as it was."""
        for tries in range(1, REQUEUE_TRIES + 1):
            try:
                return self._requeue_one(conn, message_id, record)
            except Exception as exc:
                if database_unavailable(exc, conn) or not transient_database_error(exc):
                    raise
                error = describe_error(exc)
            log.warning("inbox_requeue_retry", message_id=message_id, attempt=tries, error=error)
            time.sleep(backoff_delay(tries, base=TRANSIENT_BACKOFF, cap=TRANSIENT_BACKOFF_CAP))
        return False, f"left parked as it was: {REQUEUE_TRIES} transient database errors (last: {error})"

    def _requeue_one(
        self, conn: psycopg.Connection[tuple[Any, ...]], message_id: str, record: Any
    ) -> tuple[bool, str | None]:
        """One parked message through its handler in a transaction of its own: (True, None) applied,
        (False, reason) parked again, (False, None) requeued meanwhile by someone else."""
        with conn.transaction():
            locked = conn.execute(
                query(QUERIES, "parked_to_requeue"),
                {"consumer": self.inbox.consumer, "ids": [message_id], "error_like": None},
            ).fetchone()
            if locked is None:
                return False, None
            work = self._decode(record)
            if work.missing_id is not None or work.message.message_id != message_id:
                return False, f"its id is unusable ({work.missing_id}); left parked"
            reason = self._handle(conn, work)
            if reason is not None:
                return False, reason
            conn.execute(
                query(QUERIES, "mark_requeued_done"),
                {"consumer": self.inbox.consumer, "message_id": message_id},
            )
        # Applied and committed: the after_commit hooks run for it, as for a message a batch applies.
        self.inbox.run_after_commit([work.message], self._calls)
        return True, None

    @staticmethod
    def _offsets(records: list[Any]) -> list[TopicPartition]:
        next_offset: dict[tuple[str, int], int] = {}
        for record in records:
            key = (record.topic(), record.partition())
            next_offset[key] = max(next_offset.get(key, 0), record.offset() + 1)
        return [TopicPartition(t, p, o) for (t, p), o in next_offset.items()]

    def _store_offsets(self, consumer: Consumer, records: list[Any]) -> None:
        try:
            consumer.store_offsets(offsets=self._offsets(records))
        except KafkaException as exc:
            # Work is committed in the database; a lost offset only means a re-read of duplicates (here: a
            # partition revoked while the batch was applied, so another member reads it again).
            log.warning("inbox_offset_store_failed", error=str(exc))

    @staticmethod
    def _rewind(consumer: Consumer, records: list[Any]) -> None:
        first: dict[tuple[str, int], int] = {}
        for record in records:
            key = (record.topic(), record.partition())
            first[key] = min(first.get(key, record.offset()), record.offset())
        for (topic, partition), offset in first.items():
            consumer.seek(TopicPartition(topic, partition, offset))


@dataclass(frozen=True)
class Requeued:
    """What a requeue did: messages applied now, failed again (with their new reasons), and gone from
    the broker (retention or compaction took them; they stay failed)."""

    applied: list[str]
    failed_again: list[tuple[str, str]]
    gone: list[str]


def _count_by_topic(counter: Any, messages: Iterable[Message]) -> None:
    """One increment per topic for a batch (a labelled child's lookup per message costs more than the
    no-op handler it counts)."""
    for topic, count in collections.Counter(m.topic for m in messages).items():
        counter.labels(topic).inc(count)


def _reason(exc: BaseException | None) -> str:
    """A handler's failure as recorded with a parked message: class and primary message (no DETAIL)."""
    return f"{type(exc).__name__}: {describe_error(exc)}" if exc is not None else "unknown"


def _fetch(fetcher: Consumer, topic: str, partition: int, offset: int) -> Any:
    """The record at exactly these coordinates, or None when the broker no longer has it."""
    fetcher.assign([TopicPartition(topic, partition, offset)])
    try:
        for record in fetcher.consume(1, timeout=10):
            if record.error() is None and record.offset() == offset:
                return record
        return None
    finally:
        fetcher.unassign()
