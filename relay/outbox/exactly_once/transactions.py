"""The transactional producers of exactly-once publication, one per owned group of shards, and the
read-back of a group's last settlement when it is taken over.

Opening a group: init_transactions with the group's transactional.id (the broker fences every earlier
producer of that id: its open transaction is aborted, a commit it had begun is completed), then the last
settlement on the group's partition of the cursor topic is read with read_committed and handed to the
relay to write into PostgreSQL whatever of it is missing there. Only then does the group publish.

A batch: begin_transaction, produce its messages and its settlement, wait for every delivery report,
commit. A transaction that does not commit cleanly (aborted, a commit that times out or fails, a fenced
producer) drops the group's producer: the group is opened again, read-back included, before it publishes
again. The new producer's init_transactions bumps the producer epoch, which fences every request of the
old one still in flight: without it, a produce of an aborted transaction that the broker received late
could land in the next transaction of the same epoch (a duplicate). Kafka 4.0's transaction protocol
(KIP-890, transaction.version 2) bumps the epoch at every transaction end; librdkafka does not speak it
(confluentinc/librdkafka#5423), so postbox does it where it matters, at every transaction that fails.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from postbox.relay.core.kafka_config import with_structlog_logger
from postbox.relay.outbox.errors import Disposition, classify
from postbox.relay.outbox.exactly_once.groups import GROUP_COUNT
from postbox.relay.outbox.exactly_once.settlement import Settlement, SettlementError, decode
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import DELIVERED, Delivery
from postbox.relay.outbox.publisher import KafkaSending, send_all
from postbox.relay.outbox.routing import Message

log = structlog.get_logger("postbox.relay.exactly_once")

# The librdkafka settings a reader of the cursor topic shares with the producer: where the cluster is and
# how to log in. The producer's own (linger.ms, compression...) would only draw warnings from a consumer.
_CONNECTION_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "socket.", "broker.", "client.dns")


class GroupNotReady(RuntimeError):
    """A group could not be opened now (the broker, the read-back, or PostgreSQL's locks); tried again at
    the next lease tick."""


class Ending(Enum):
    COMMITTED = "committed"
    ABORTED = "aborted"  # known not committed
    UNKNOWN = "unknown"  # may or may not be committed: the group is read back before it publishes again


@dataclass
class OpenTransaction:
    group: int
    producer: Producer
    sending: KafkaSending  # the batch's messages
    began: float  # time.monotonic()
    settlement: list[Delivery] = field(default_factory=list)  # the settlement's report, once in

    def on_settlement(self, error: KafkaError | None, _message: Any) -> None:
        self.settlement.append(
            DELIVERED if error is None else Delivery(classify(error.code(), error.fatal()), error.str())
        )


class Transactions:
    def __init__(
        self,
        producer_config: dict[str, str | int | float | bool],
        *,
        relay_id: str,
        metrics: RelayMetrics,
        timeout: float = 10.0,
    ) -> None:
        """producer_config: the relay's producer settings; each group's producer adds its transactional.id
        (`{prefix}-{group}`, the prefix given to `bind` once the outbox is known). timeout: how long one
        init, commit, abort or metadata request may take (the relay keeps it well inside its lease)."""
        self._config = producer_config
        self._delivery_timeout = float(producer_config.get("message.timeout.ms", 300_000)) / 1000
        self._prefix = ""
        self.cursor_topic = ""
        self._topic_ready = False
        self._relay_id = relay_id
        self._metrics = metrics
        self._timeout = timeout
        self._producers: dict[int, Producer] = {}
        self._open: dict[int, float] = {}  # group -> when its open transaction began (monotonic)
        self._reader: Consumer | None = None
        metrics.open_transaction_seconds.set_function(self.oldest_open_seconds)

    # -- the cursor topic -------------------------------------------------------------------------------

    def bind(self, prefix: str) -> None:
        """The transactional-id prefix of the outbox the relay is connected to (at each connect: a relay
        pointed at another outbox starts over)."""
        if prefix != self._prefix:
            self.drop_all()
            self._prefix, self.cursor_topic, self._topic_ready = prefix, f"{prefix}.cursors", False
            log.info(
                "relay_exactly_once_prefix", transactional_ids=f"{prefix}-<group>", topic=self.cursor_topic
            )

    def ensure_cursor_topic(self) -> None:
        """Create the cursor topic (compacted, a partition per group) unless it exists, once; a topic with
        fewer partitions than groups is a configuration error (raised as ValueError), one the cluster does
        not show yet (or a broker that does not answer in time) is not ready (GroupNotReady)."""
        if self._topic_ready:
            return
        admin = AdminClient(with_structlog_logger(self._connection_config()))
        config = {"cleanup.policy": "compact", "segment.ms": str(3_600_000)}
        futures = admin.create_topics(
            [NewTopic(self.cursor_topic, GROUP_COUNT, config=config)],
            request_timeout=self._timeout,
            operation_timeout=self._timeout,
        )
        try:
            futures[self.cursor_topic].result(timeout=self._timeout + 5)
            log.info("relay_cursor_topic_created", topic=self.cursor_topic, partitions=GROUP_COUNT)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        except concurrent.futures.TimeoutError:
            raise GroupNotReady(f"creating the cursor topic {self.cursor_topic}: no answer in time") from None
        found = admin.list_topics(self.cursor_topic, timeout=self._timeout).topics.get(self.cursor_topic)
        if found is None or found.error is not None or not found.partitions:
            # Just created (by this relay or another): the metadata catches up within moments.
            raise GroupNotReady(f"the cursor topic {self.cursor_topic} is not in the cluster's metadata yet")
        partitions = len(found.partitions)
        if partitions < GROUP_COUNT:
            raise ValueError(
                f"the cursor topic {self.cursor_topic} has {partitions} partitions; exactly-once needs "
                f"{GROUP_COUNT}, one per group of shards"
            )
        self._topic_ready = True

    def _connection_config(self) -> dict[str, Any]:
        return {k: v for k, v in self._config.items() if k.startswith(_CONNECTION_PREFIXES)}

    # -- groups -----------------------------------------------------------------------------------------

    @property
    def ready(self) -> frozenset[int]:
        """The groups whose producer is open and whose last settlement PostgreSQL has."""
        return frozenset(self._producers)

    def sync(
        self,
        groups: Sequence[int],
        settle: Callable[[Settlement], bool],
        between: Callable[[], None],
    ) -> None:
        """Close the producers of groups no longer owned; open those of owned groups not open yet, each
        one's last settlement handed to `settle` (False: PostgreSQL could not take it now). `between` is
        called between the steps (the relay renews its leases there). No batch is in flight.

        The groups' producers are initialised side by side: init_transactions takes about half a second
        (librdkafka looks up the transaction coordinator on a 500 ms timer), and one group after another
        a relay that started, or took over 8 groups, left the last of them 4 s unpublished (the p99 at
        1,000 events/s was 2.4 s for it). Reading back and settling stay one group at a time: one reader,
        one lease connection."""
        wanted = set(groups)
        for group in sorted(self._producers.keys() - wanted):
            self.drop(group)
        missing = sorted(wanted - self._producers.keys())
        if missing:
            between()
            for group, initialised in zip(missing, self._initialise(missing), strict=True):
                if isinstance(initialised, Exception):
                    log.warning("relay_group_not_ready", group=group, error=str(initialised))
                    continue
                between()
                try:
                    self._producers[group] = self._open_group(group, *initialised, settle)
                except (GroupNotReady, KafkaException, SettlementError) as exc:
                    log.warning("relay_group_not_ready", group=group, error=str(exc))
        self._metrics.groups_ready.set(len(self._producers))

    def _initialise(self, groups: Sequence[int]) -> list[tuple[Producer, float] | KafkaException]:
        """Each group's new producer, its init_transactions done (fencing every older producer of the
        group), with when it began; or why not. Side by side, a thread per group."""

        def initialise(group: int) -> tuple[Producer, float] | KafkaException:
            started = time.monotonic()
            config = {
                **self._config,
                "transactional.id": f"{self._prefix}-{group}",
                "client.id": f"{self._config.get('client.id', 'postbox-relay')}-group{group}",
                "error_cb": _log_error(group),
            }
            config.pop("statistics.interval.ms", None)  # no stats_cb here: the relay's main producer reports
            try:
                producer = Producer(with_structlog_logger(config))
                producer.init_transactions(self._timeout)
            except KafkaException as exc:
                return exc
            return producer, started

        if len(groups) == 1:
            return [initialise(groups[0])]
        with concurrent.futures.ThreadPoolExecutor(
            len(groups), thread_name_prefix="relay-group-init"
        ) as pool:
            return list(pool.map(initialise, groups))

    def _open_group(
        self, group: int, producer: Producer, started: float, settle: Callable[[Settlement], bool]
    ) -> Producer:
        """The group's initialised producer, once its last settlement is read back and settled."""
        settlement = self._read_back(group)
        if settlement is not None:
            if settlement.group != group:
                raise SettlementError(f"partition {group} holds a settlement of group {settlement.group}")
            if not settle(settlement):
                raise GroupNotReady("PostgreSQL could not take the group's last settlement now")
        log.info(
            "relay_group_opened",
            group=group,
            settled_by=settlement.relay_id if settlement is not None else None,
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        return producer

    def _read_back(self, group: int) -> Settlement | None:
        """The last committed settlement on the group's partition (read_committed), or None. A reader that
        fails is replaced: after a broker restart one was seen to answer "unknown partition" for good (the
        30-minute soak, 2026-12-07: two groups never opened again)."""
        try:
            return self._read_back_with(self._reader_now(), group)
        except (KafkaException, GroupNotReady):
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            raise

    def _reader_now(self) -> Consumer:
        if self._reader is None:
            self._reader = Consumer(
                with_structlog_logger(
                    {
                        **self._connection_config(),
                        "group.id": f"{self._prefix}-read-back",
                        "isolation.level": "read_committed",
                        "enable.auto.commit": False,
                        "enable.partition.eof": True,
                    }
                )
            )
        return self._reader

    def _read_back_with(self, reader: Consumer, group: int) -> Settlement | None:
        low, high = reader.get_watermark_offsets(
            TopicPartition(self.cursor_topic, group), timeout=self._timeout, cached=False
        )
        start = max(low, high - 64)  # each transaction takes two offsets: the record and its marker
        while high > low:
            value = self._last_value(reader, group, start)
            if value is not None:
                return decode(value)
            if start <= low:
                return None
            start = max(low, start - 4 * (high - start))
        return None

    def _last_value(self, reader: Consumer, group: int, start: int) -> bytes | None:
        reader.assign([TopicPartition(self.cursor_topic, group, start)])
        last: bytes | None = None
        deadline = time.monotonic() + 3 * self._timeout
        try:
            while time.monotonic() < deadline:
                message = reader.poll(0.5)
                if message is None:
                    continue
                error = message.error()
                if error is None:
                    last = message.value()
                elif error.code() == KafkaError._PARTITION_EOF:
                    return last
                else:
                    raise KafkaException(error)
            raise GroupNotReady(f"the cursor topic's partition {group} was not read to its end in time")
        finally:
            reader.unassign()

    def drop(self, group: int) -> None:
        """Forget the group's producer (its open transaction, if any, is aborted by the broker when the
        group is opened again, by this relay or another, or at transaction.timeout.ms)."""
        self._producers.pop(group, None)
        self._open.pop(group, None)
        self._metrics.groups_ready.set(len(self._producers))

    def drop_all(self) -> None:
        for group in list(self._producers):
            self.drop(group)

    def close(self) -> None:
        self.drop_all()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # -- a batch's transaction --------------------------------------------------------------------------

    def begin(
        self, group: int, messages: Sequence[Message], settlement: Settlement, record_acks: bool = False
    ) -> OpenTransaction | None:
        """Begin the group's transaction and produce the batch's messages and its settlement; None, with the
        group dropped (opened again at the next lease tick), when its producer cannot begin one (fenced by
        a newer owner, or failed)."""
        producer = self._producers[group]
        try:
            producer.begin_transaction()
            began = time.monotonic()
            self._open[group] = began
            sending = send_all(producer, messages, self._delivery_timeout, _nothing, record_acks)
        except KafkaException as exc:
            log.warning("relay_transaction_not_begun", group=group, error=exc.args[0].str())
            self.drop(group)
            return None
        transaction = OpenTransaction(group, producer, sending, began)
        try:
            producer.produce(
                self.cursor_topic,
                settlement.encode(),
                str(group).encode(),
                partition=group,
                on_delivery=transaction.on_settlement,
            )
        except (KafkaException, BufferError) as exc:
            transaction.settlement.append(Delivery(Disposition.RETRY, f"settlement not produced: {exc}"))
        return transaction

    def wait(self, transaction: OpenTransaction, while_waiting: Callable[[], None]) -> list[Delivery]:
        """The messages' reports, once the settlement's is in too (or overdue: a failure)."""
        try:
            reports = transaction.sending.wait(while_waiting)
            deadline = time.monotonic() + self._delivery_timeout + 10
            next_tick = time.monotonic() + 1
            while not transaction.settlement and time.monotonic() < deadline:
                transaction.producer.poll(0.005)
                if time.monotonic() >= next_tick:
                    while_waiting()
                    next_tick = time.monotonic() + 1
        except KafkaException as exc:  # a transactional producer raises its fatal errors (fenced) here
            error = exc.args[0]
            failed = Delivery(Disposition.FATAL if error.fatal() else classify(error.code()), error.str())
            transaction.settlement[:] = [failed]
            return [failed] * len(transaction.sending.results)
        return reports

    def settlement_delivered(self, transaction: OpenTransaction) -> Delivery:
        return (
            transaction.settlement[0]
            if transaction.settlement
            else Delivery(Disposition.RETRY, "the settlement's delivery report is overdue")
        )

    def commit(self, transaction: OpenTransaction) -> Ending:
        try:
            transaction.producer.commit_transaction(self._timeout)
            return self._ended(transaction, Ending.COMMITTED)
        except KafkaException as exc:
            error = exc.args[0]
            log.warning("relay_transaction_commit_failed", group=transaction.group, error=error.str())
            if error.txn_requires_abort() and not error.fatal():
                return self.abort(transaction)
            # Timed out, fenced or fatal: committed or not, the broker knows; the read-back will tell.
            self.drop(transaction.group)
            return self._ended(transaction, Ending.UNKNOWN)

    def abort(self, transaction: OpenTransaction) -> Ending:
        """Abort the transaction and drop the group's producer (the relay opens the group again, and reads
        it back, before it sends again: see Relay._abort)."""
        try:
            transaction.producer.abort_transaction(self._timeout)
        except KafkaException as exc:
            # Never committed (an abort is asked only before a commit succeeds): the next init aborts it.
            log.warning("relay_transaction_abort_failed", group=transaction.group, error=exc.args[0].str())
        self.drop(transaction.group)
        return self._ended(transaction, Ending.ABORTED)

    def _ended(self, transaction: OpenTransaction, ending: Ending) -> Ending:
        self._open.pop(transaction.group, None)
        self._metrics.transactions.labels(ending.value).inc()
        self._metrics.transaction_seconds.observe(time.monotonic() - transaction.began)
        return ending

    def oldest_open_seconds(self) -> float:
        """How long the oldest open transaction has been open (0 with none): read_committed consumers of
        its partitions wait for it."""
        began = list(self._open.values())
        return time.monotonic() - min(began) if began else 0.0


def _nothing() -> None:
    pass


def _log_error(group: int) -> Callable[[KafkaError], None]:
    def on_error(error: KafkaError) -> None:
        # A group's producer that is fenced or fails fatally fails its next commit: handled there.
        log.warning("relay_group_producer_error", group=group, error=error.str(), fatal=error.fatal())

    return on_error
