"""The Kafka inbox consumer: poll, apply in PostgreSQL (inbox.applying), then commit offsets.

For each poll, the batch (what has arrived) is applied in one transaction: claimed, handled, parked where
a handler keeps failing, committed (inbox.applying says how). Only then are its offsets stored, for
librdkafka to commit. This module is the Kafka side: the group membership, readiness, offsets, re-reading
a batch a transient database error rolled back, and renewing a consumer librdkafka left stuck.

What a crash at each step leaves behind: before the commit, nothing (the batch is read again); after the
commit and before the offset commit, the claims are durable, so the re-read batch is all duplicates and
changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from postbox.inbox.applying import TRANSIENT_BACKOFF, TRANSIENT_BACKOFF_CAP, Applier, Work, decode
from postbox.inbox.calling import HandlerCaller, check_no_running_loop
from postbox.inbox.dead_letters import DeadLetters
from postbox.inbox.handlers import Inbox
from postbox.inbox.message import Message
from postbox.inbox.metrics import InboxMetrics
from postbox.inbox.requeue import Requeued, requeue
from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from postbox.relay.core.db import (
    connect,
    database_unavailable,
    describe_error,
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

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


log = structlog.get_logger("postbox.inbox")
LAG_INTERVAL = 15.0
# Readiness is checked, not assumed from traffic: every this many seconds the turn runs `SELECT 1` and,
# while all brokers were reported down, asks the cluster for metadata.
PROBE_INTERVAL = 5.0
# A consumer out of its group this long while the brokers answer has been left without an assignment
# (seen after broker faults: revoked, then never assigned again): it is renewed, as for #5586 below.
REJOIN_LIMIT = 60.0
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
        self.daemon = Daemon("inbox")
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
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
        # Applies each batch; its HandlerCaller runs the handlers, def or async def, in this thread.
        self.applier = Applier(inbox, self.metrics, HandlerCaller())

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
            self.applier.dead_letters = DeadLetters.producing_to(
                self.inbox.dead_letter_topic, self.settings.kafka_bootstrap, self.settings.kafka_config
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
            if self.applier.dead_letters is not None:
                self.applier.dead_letters.close()
            self._close_db()
            self.applier.calls.close()
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
            if self.applier.dead_letters is not None:
                # Serves its log lines (kafka_client_log) while idle too: delivered only on poll.
                self.applier.dead_letters.serve()
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
        self.applier.calls.close()

    def _close_db(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _apply(self, records: list[Any]) -> None:
        work = [decode(r, self.inbox) for r in records]
        if self._tracer is None:
            self.applier.apply(self._db(), work)
            return
        from postbox.inbox.tracing import BatchSpans  # noqa: PLC0415  (OpenTelemetry is optional)

        group = self.settings.group_id or self.inbox.consumer
        spans = BatchSpans(self._tracer, [w.message for w in work], group, self.inbox.consumer)
        self.applier.spans = spans
        try:
            self.applier.apply(self._db(), work)
        except BaseException as exc:
            spans.end(exc)
            raise
        else:
            spans.end()
        finally:
            self.applier.spans = None

    def apply_messages(self, messages: list[Message]) -> None:
        """Apply messages handed over directly, exactly as a batch read from Kafka is applied (claim,
        handlers, parking, commit, after_commit hooks); the test harness (inbox.testing) uses it."""
        self.applier.apply(self._db(), [Work(message) for message in messages])

    def requeue(self, *, ids: list[str] | None = None, error_like: str | None = None) -> Requeued:
        """`postbox inbox requeue` (inbox.requeue), on this consumer's database and brokers."""
        fetcher_config = {"bootstrap.servers": self.settings.kafka_bootstrap, **self.settings.kafka_config}
        try:
            return requeue(self.applier, self._db(), fetcher_config, ids=ids, error_like=error_like)
        finally:
            self.close()

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
