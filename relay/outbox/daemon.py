"""The relay loop: claim a batch, publish it, mark it, commit; again while batches come back full.

The owned shards are dealt into lanes (--lanes, default 2), each with its own connection and, with more
than one, its own thread. A lane's batches run strictly one after another, but lanes overlap: while one
lane waits (for PostgreSQL's answer, for Kafka's acks), another reads its rows and hands its messages to
the producer. A shard belongs to one lane, so no aggregate is ever in two open batches.

What a crash at each step leaves behind:
- before the claim commits nothing changed; after produce but before the mark commits, the rows are still
  pending and their locks die with the connection, so the next owner publishes them again (a duplicate with
  the same event id, never a loss);
- the mark is one statement in the transaction that holds the row locks, fenced on the shard lease.

This module is the loop: connections, the lease turn, lanes, and a batch's begin and finish. It knows no
mode: where a batch's rows come from, and how their outcomes are written back, is its BatchSource's
(sources/: the queue or the log; following the outbox's mode swaps the source). Nor does it know its
delivery guarantee: how a batch reaches Kafka, and whether its outcome may then be written, is
delivery.py's (at least once; exactly_once/delivery.py with --exactly-once). Beside it: batch.py
prepares a page into messages, batch_report.py reports a finished batch, topic_gate.py keeps the topics
held back, relay_id.py the one-live-replica-per-id lock, leases.py the shard leases, housekeeping.py
the gauges and upkeep on a thread of their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import structlog
from psycopg.types.string import TextLoader

from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from postbox.relay.core.db import describe_error, transient_database_error
from postbox.relay.core.sql import query
from postbox.relay.core.tracing import TRACING_OFF, Tracing
from postbox.relay.outbox import admin
from postbox.relay.outbox.batch import InFlight, Preparer
from postbox.relay.outbox.batch_report import report_batch
from postbox.relay.outbox.delivery import AtLeastOnce, DeliveryGuarantee, LeaseTurn, Rollback
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.held import HeldAggregates
from postbox.relay.outbox.housekeeping import CENSUS_SECONDS, Housekeeping, Steps
from postbox.relay.outbox.lane_turns import LaneTurns
from postbox.relay.outbox.leases import LeaseKeeper
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import Delivery
from postbox.relay.outbox.publisher import Publisher
from postbox.relay.outbox.relay_id import RelayIdInUse, lock_relay_id
from postbox.relay.outbox.routing import TopicRoutes
from postbox.relay.outbox.settings import RelaySettings
from postbox.relay.outbox.sources.base import BatchSource, ReadLimits, RelayConfigurationError
from postbox.relay.outbox.sources.choice import make_source, mode_to_read
from postbox.relay.outbox.sources.queue import Claimer
from postbox.relay.outbox.topic_gate import TopicGate

if TYPE_CHECKING:
    from postbox.relay.outbox.tracing import PublishSpans

QUERIES = Path(__file__).with_name("queries.sql")
NOTIFY_CHANNEL = "postbox_outbox"
log = structlog.get_logger("postbox.relay")

Connection = psycopg.Connection[tuple[Any, ...]]


class FatalRelayError(RuntimeError):
    """The relay cannot go on (fatal producer error); delivered rows were marked, nothing else."""


class Relay:
    def __init__(
        self,
        settings: RelaySettings,
        publisher: Publisher,
        metrics: RelayMetrics,
        connect: Callable[[bool], Connection],
        tracing: Tracing = TRACING_OFF,
        delivery: DeliveryGuarantee | None = None,
    ) -> None:
        """delivery: how batches reach Kafka (delivery.py; by default at least once, through `publisher`;
        with --exactly-once, Kafka transactions, `publisher` then only answering about topics and
        brokers)."""
        self.settings = settings
        self.publisher = publisher
        self.metrics = metrics
        self._connect = connect  # connect(autocommit) -> a connection with search_path set
        # A batch legitimately waits up to the delivery timeout for its acks, twice over with two lanes.
        self.daemon = Daemon(
            "relay", stall_limit=max(60.0, 2 * settings.delivery_timeout + 30), backoff=self._backoff
        )
        self._topics = TopicGate()
        self._held = HeldAggregates()  # aggregates waiting for a blocked topic (pages read past)
        self._held_shards: frozenset[int] | None = None  # the shards owned when it was last loaded
        self._next_held_reload = 0.0
        self._claimer = Claimer.of(settings)
        # Chosen at each connect and lease tick (_check_mode): --mode, or with auto the outbox's mode.
        self._source: BatchSource | None = None
        self._housekeeping: Housekeeping | None = None  # gauges, census, partitions, pruning: own thread
        self.connected = False
        self._batch_conns: list[Connection] = []  # one per lane
        self._lease_conn: Connection | None = None
        self._listen_conn: Connection | None = None
        self.leases: LeaseKeeper | None = None
        self._failed_batches = 0
        self._delivery = delivery if delivery is not None else AtLeastOnce(publisher)
        self._woke_at = 0.0  # wall clock: when the last wait ended (a NOTIFY, the poll interval, a stop)
        self._waiting_for_id: str | None = None  # why we wait: another replica holds our relay id
        self._broker_trouble: tuple[float, str] | None = None  # as last seen by the main loop
        spans: PublishSpans | None = None
        # The lease connection serves every lane: renewing while a batch waits, and the log source's
        # ticks (a transaction of two statements, which another lane's statement must not join).
        self._lease_lock = threading.Lock()
        self._lane_pool: ThreadPoolExecutor | None = None  # with more than one lane: a thread per lane
        self._lane_failed = threading.Event()  # a lane raised: the others finish their batch and stop
        if tracing.tracer is not None:  # imported only then: OpenTelemetry is an optional dependency
            from postbox.relay.outbox.tracing import PublishSpans  # noqa: PLC0415

            spans = PublishSpans(tracing.tracer, tracing.follows_parent)
        self._preparer = Preparer(
            TopicRoutes(settings.topic_template),
            settings.event_type_header,
            self._held,
            self._check_topic,
            spans,
        )

    # -- lifecycle -------------------------------------------------------------------------------------

    def stop(self, *_: object) -> None:
        """Ask the loop to finish the batch in flight and exit (SIGTERM, SIGINT)."""
        self.daemon.stop()

    def install_signal_handlers(self) -> None:
        self.daemon.install_signal_handlers()

    def run(self) -> int:
        """Run until stopped; 0 after a clean stop. Raises FatalRelayError when the producer is broken."""
        log.info(
            "relay_started",
            relay_id=self.settings.relay_id,
            schema=self.settings.schema,
            mode=self.settings.mode,
            # None without --batch-size: relay_mode_followed logs the source's once the mode is known.
            batch_size=self.settings.batch_size,
        )
        try:
            self.daemon.run(self._loop_turn, lost=self._lost, on_lost=self._on_lost)
        finally:
            self._shutdown()
        log.info("relay_stopped", relay_id=self.settings.relay_id)
        return 0

    def _loop_turn(self) -> None:
        self._ensure_connected()
        assert self._housekeeping is not None
        self._housekeeping.check()
        full = self._turn()
        if self.publisher.fatal_error:
            raise FatalRelayError(self.publisher.fatal_error)
        if not full:
            # Inside the turn: the LISTEN session can be cut while we wait, like any other.
            again = self._source.look_again_in() if self._source is not None else None
            self._wait(
                self.settings.poll_interval if again is None else min(again, self.settings.poll_interval)
            )

    def _lost(self, exc: BaseException) -> bool:
        """The relay goes on after losing its database, or while another replica holds its relay id."""
        # A statement that lost a race (a deadlock, a lock or statement timeout) is nobody's bad input
        # either: the relay starts over on new connections, its rows still pending or its cursors where
        # they were (duplicates at most).
        return isinstance(exc, RelayIdInUse) or transient_database_error(exc, *self._connections())

    def _backoff(self, losses: int) -> float:
        # Waiting for our relay id is waiting for a lease to lapse (or a stale session to be ended): look
        # again within seconds, where a lost database backs off to the daemon's 30 s.
        return backoff_delay(losses, cap=5.0 if self._waiting_for_id is not None else 30.0)

    def _on_lost(self, exc: BaseException) -> None:
        if isinstance(exc, RelayIdInUse):
            log.error("relay_id_in_use", relay_id=self.settings.relay_id, reason=str(exc))
            self._waiting_for_id = str(exc)
        self._disconnect()

    def _connections(self) -> tuple[Connection | None, ...]:
        housekeeping = self._housekeeping.conn if self._housekeeping is not None else None
        return (*self._batch_conns, self._lease_conn, self._listen_conn, housekeeping)

    def _ensure_connected(self) -> None:
        if self._batch_conns and self._lease_conn is not None:
            return
        self._batch_conns = [self._connect(False) for _ in range(self.settings.lanes)]
        for conn in self._batch_conns:
            conn.execute(query(QUERIES, "lane_session"))
            conn.commit()
            _headers_as_text(conn)
        self._lease_conn = self._connect(True)
        lock_relay_id(self._lease_conn, self.settings.schema, self.settings.relay_id, self.settings.lease_ttl)
        self._waiting_for_id = None
        self._check_mode(self._lease_conn)
        self._delivery.connected(self._lease_conn)
        if self.settings.delete_on_publish:
            allowed = self._lease_conn.execute(query(QUERIES, "may_delete")).fetchone()
            if not (allowed and allowed[0]):
                raise RelayConfigurationError(
                    "delete-on-publish: this role may not DELETE from the outbox "
                    f"(GRANT DELETE ON {self.settings.schema}.outbox TO the relay's role)"
                )
        allowed = self._lease_conn.execute(query(QUERIES, "may_maintain_partitions")).fetchone()
        if not (allowed and allowed[0]):
            raise RelayConfigurationError(
                "this role may not keep the outbox's partitions (GRANT EXECUTE ON FUNCTION "
                f"{self.settings.schema}.outbox_maintain_partitions(bigint, interval) and GRANT SELECT ON "
                f"{self.settings.schema}.outbox_partition TO the relay's role; deploy/sql/roles.sql does)"
            )
        if self.settings.listen:
            # Its own connection, used for nothing else, so no notification is consumed by another query.
            self._listen_conn = self._connect(True)
            self._listen_conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        self.leases = LeaseKeeper(
            self._lease_conn,
            self.settings.relay_id,
            self.settings.lease_ttl,
            group_shards=self._delivery.lease_group,
        )
        self._housekeeping = Housekeeping(
            self._connect,
            self.metrics,
            interval=self.settings.lease_ttl / 3,  # as often as leases are renewed
            partition_xids=self.settings.partition_xids,
            prune_retention=self.settings.prune_retention,
            prune_interval=self.settings.prune_interval,
            source_upkeep=self._source_upkeep,
        )
        self._housekeeping.keep_partitions(self._lease_conn)  # then every round, on its own thread
        self._housekeeping.start()
        self.connected = True
        log.info("relay_connected")

    def _check_mode(self, conn: Connection) -> None:
        """At every connect and lease tick (no batch open): read from the source mode_to_read says, swapping
        it when the outbox's mode changed under --mode auto. A switch waits only for open batches, so an
        idle relay, or one cut off from the database, finds it here."""
        current = self._source
        mode, reason = mode_to_read(conn, self.settings.mode, current.name if current is not None else None)
        self._delivery.check_mode(mode)
        if current is not None and current.name == mode:
            return
        if current is not None and self._lease_conn is not None:
            current.close(self._lease_conn)  # so that status shows where the log stands
        self._source = make_source(
            mode,
            self.settings,
            self._claimer,
            tick_conn=self._tick_conn,
            tick_lock=self._lease_lock,
            metrics=self.metrics,
        )
        # Once at the start (reason "--mode" when pinned), and at every change of modes under --mode auto.
        log.info("relay_mode_followed", mode=mode, batch_size=self._source.rows_per_batch, reason=reason)

    def _tick_conn(self) -> Connection:
        assert self._lease_conn is not None
        return self._lease_conn

    def _source_upkeep(self, conn: Connection) -> None:
        """Housekeeping's round for the source read now (its thread; the source may be swapped meanwhile)."""
        source = self._source
        if source is not None:
            source.upkeep(conn)

    def _disconnect(self) -> None:
        self.connected = False
        self._delivery.disconnected()
        if self._housekeeping is not None:
            self._housekeeping.stop()
            self._housekeeping = None
        for conn in self._connections():
            if conn is not None:
                conn.close()
        self._batch_conns = []
        self._lease_conn = self._listen_conn = None
        self.leases = None

    def _shutdown(self) -> None:
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=True)  # drain() returned: no lane has a batch in flight
            self._lane_pool = None
        self.publisher.close(self.settings.delivery_timeout)
        self._delivery.close()
        if self.leases is not None:
            try:
                if self._source is not None and self._lease_conn is not None:
                    self._source.close(self._lease_conn)
                self.leases.release_all()
            except psycopg.Error as exc:  # the leases then simply expire; nothing is lost either way
                log.warning("relay_release_failed", error=describe_error(exc))
        self._disconnect()

    def healthy(self) -> tuple[bool, str]:
        housekeeping = self._housekeeping
        stalled = housekeeping.stalled_for() if housekeeping is not None else 0.0
        if stalled > self.daemon.stall_limit:
            return False, f"housekeeping (gauges, partitions) last finished a round {stalled:.0f}s late"
        return self.daemon.healthy()

    def ready(self) -> tuple[bool, str]:
        problem = next(self._readiness_problems(), None)
        if problem is not None:
            return False, problem
        assert self.leases is not None
        return True, f"ok: {len(self.leases.owned)} shards"

    def _readiness_problems(self) -> Iterator[str]:
        """Why this replica should not take traffic, most basic first."""
        if self._waiting_for_id is not None:
            yield self._waiting_for_id
        if not self.connected:
            yield "not connected to PostgreSQL"
        if self.publisher.fatal_error:
            yield self.publisher.fatal_error
        if self._broker_trouble is not None:
            since, reason = self._broker_trouble
            # A blip shorter than the delivery timeout costs nothing (librdkafka retries), so it must not
            # drain the Service: unready only past that.
            waited = time.monotonic() - since
            if waited >= self.settings.delivery_timeout:
                yield f"Kafka unusable for {waited:.0f}s: {reason}"
        blocked = self._topics.reasons()
        if blocked:
            yield "blocked topics: " + ", ".join(f"{t} ({r})" for t, r in blocked.items())
        if self.leases is None or not self.leases.owned:
            yield "owns no shard yet"
        else:
            problem = self._delivery.not_ready(self.leases.owned)
            if problem is not None:
                yield problem

    # -- one turn of the loop --------------------------------------------------------------------------

    def _turn(self) -> bool:
        """Maintain leases, drain the lanes. True when rows may still be waiting."""
        assert self.leases is not None
        if self.leases.due():
            # Every lane is paused meanwhile, so nothing else is done here (gauges, partitions and pruning
            # are Housekeeping's): the debug line has each step's time (tests/bench/first_minute).
            steps = Steps()
            owned = self.leases.tick()
            steps.done("lease_tick")
            self.metrics.shards_owned.set(len(owned))
            self.metrics.leases_lost.inc(len(self.leases.lost))
            assert self._lease_conn is not None
            self._check_mode(self._lease_conn)
            steps.done("check_mode")
            self._delivery.lease_turn(
                LeaseTurn(
                    self._lease_conn, self._lease_lock, frozenset(owned), self.leases.lost, self._keep_leases
                )
            )
            steps.done("delivery")
            self._refresh_held(frozenset(owned))
            steps.done("held")
            log.debug("relay_lease_turn", began_at=steps.began_at, ms=steps.ms)
        if self._topics.blocked and time.monotonic() >= self._topics.next_recheck:
            self._recheck_blocked_topics()
        self._broker_trouble = self.publisher.broker_trouble()
        self.metrics.ready.set(1 if self.ready()[0] else 0)
        if not self.leases.owned:
            return False
        return self.drain()

    def drain(self) -> bool:
        """Run batches on every lane until the lanes come up empty or it is time to stop (a lease tick is
        due, SIGTERM, a failing broker). Each lane runs its batches one after another, each claimed as
        soon as the one before is marked, full or not: under steady traffic rows committed while that
        batch waited for its acks. With more than one lane, each runs in a thread of its own, so that one
        lane's wait (for PostgreSQL, for Kafka's acks) is another's time to read rows and produce: in
        one thread, every statement's wait stopped the whole relay (the log-mode drain spent about half
        its time so). A lane has at most one batch in flight, so order holds per shard. Every batch
        begun is finished before returning: leases change only with nothing in flight. True when some
        lane's last batch was full (rows may be waiting)."""
        assert self.leases is not None
        dealt = self._delivery.lanes(self.leases.owned, len(self._batch_conns))
        lanes = list(zip(self._batch_conns, dealt, strict=False))
        self._lane_failed.clear()
        turns = LaneTurns(len(lanes))
        if len(lanes) <= 1:
            more = any(self._drain_lane(index, conn, lane, turns) for index, (conn, lane) in enumerate(lanes))
        else:
            if self._lane_pool is None:
                self._lane_pool = ThreadPoolExecutor(len(self._batch_conns), thread_name_prefix="relay-lane")
            more = _all_lanes(
                [
                    self._lane_pool.submit(self._drain_lane, index, conn, lane, turns)
                    for index, (conn, lane) in enumerate(lanes)
                ]
            )
        if self._failed_batches:
            # Nothing got through: the broker is struggling. Back off longer after each such batch.
            self.daemon.sleep(backoff_delay(self._failed_batches))
        return more

    def _drain_lane(self, index: int, conn: Connection, lane: list[int], turns: LaneTurns) -> bool:
        """One lane's batches, one after another, until no lane finds anything (see LaneTurns) or no
        further batch may begin; True when it stopped after a full batch."""
        full = False
        try:
            first = True  # the first claim always: a turn after a failed batch is the retry after its backoff
            while first or self._may_begin():
                first = False
                seen = turns.finished
                batch = self._begin(conn, lane)
                if batch is None:
                    if turns.look_again(index, seen):
                        continue
                    return False
                self._finish(batch)
                self.daemon.beat()
                turns.batch_finished()
                full = batch.full
            return full
        except BaseException:
            self._lane_failed.set()
            raise
        finally:
            turns.leave()

    def _may_begin(self) -> bool:
        assert self.leases is not None
        return not (
            self.daemon.stopping
            or self.leases.due()
            or self.publisher.fatal_error
            or self._failed_batches
            or self._lane_failed.is_set()
        )

    def _keep_leases(self) -> None:
        """Renew the leases while a batch waits (for acks, for a topic's metadata)."""
        assert self.leases is not None
        with self._lease_lock:
            self.leases.renew_only()

    def _begin(self, conn: Connection, lane: list[int]) -> InFlight | None:
        """Read the lane's next page (opening the batch's transaction) and hand its messages to the
        producer; None, with the transaction closed, when there is nothing to do."""
        readable = self._delivery.readable(lane)
        return self._read_batch(conn, readable) if readable else None

    def _read_batch(self, conn: Connection, lane: list[int]) -> InFlight | None:
        assert self.leases is not None
        assert self._source is not None
        started = time.perf_counter()
        max_message = self.settings.max_message_bytes
        limits = ReadLimits(
            self._source.rows_per_batch,
            max_message,
            self.settings.max_batch_bytes,
            *self._topics.claim_filter(),
        )
        woke_at = self._woke_at
        page = self._source.read(conn, lane, limits)
        claimed_at, claim_seconds = time.time(), time.perf_counter() - started
        if page is None:
            # Ends the transaction, and with it the shards' locks (and any cursor moved past empty
            # windows is kept).
            conn.commit()
            return None
        claimed = page.claimed  # more than the records when cut at the byte budget
        prepared = self._preparer.prepare(page.records, page.read_past, max_message)
        spans = None
        if self._preparer.spans is not None and prepared.messages:
            spans = self._preparer.start_spans(prepared)
        sent_before = prepared.sent
        delivery = self._delivery.begin(page, prepared, record_acks=spans is not None)
        if delivery is None:
            # Nothing could be sent (exactly-once: a group's producer is fenced by a newer owner, or
            # failed): the batch is read again after the lease tick.
            conn.rollback()
            self.leases.recheck_now()
            return None
        if spans is not None and prepared.sent is not sent_before:  # fewer rows sent than prepared
            kept = set(prepared.sent)
            spans = [span for i, span in zip(sent_before, spans, strict=True) if i in kept]
        return InFlight(
            conn,
            lane,
            prepared.rows,
            prepared.topics,
            prepared.deliveries,
            prepared.sent,
            delivery,
            started,
            page,
            claimed >= limits.rows or claimed > len(prepared.rows),
            woke_at,
            claimed_at,
            claim_seconds,
            spans,
        )

    def _finish(self, batch: InFlight) -> None:
        """Wait for the batch's delivery reports, mark its rows in its transaction, commit; or roll it back
        when its delivery guarantee says so (exactly-once: a Kafka transaction that did not commit)."""
        assert self.leases is not None
        deliveries = batch.deliveries
        batch.delivery.wait(deliveries, self._keep_leases)
        acked_at = time.time()
        final = [d if d is not None else Delivery(Disposition.RETRY, "not sent") for d in deliveries]
        rows = batch.rows
        for index, delivery in enumerate(final):
            if delivery.disposition is Disposition.TOPIC_BLOCKED or (
                delivery.disposition is Disposition.HOLD and delivery.held_for == batch.topics[index]
            ):
                row = rows[index]
                self._topics.block(
                    batch.topics[index], delivery.reason or "", None if row.topic else row.aggregate_type
                )
        self.metrics.blocked_topics.set(len(self._topics.reasons()))
        outcome = batch.delivery.settle(rows, final, self._keep_leases)
        if isinstance(outcome, Rollback):
            batch.conn.rollback()
            self.leases.recheck_now()  # exactly-once: the batch's groups are opened again at the tick
            if outcome.back_off:
                self._failed_batches += 1
            return
        if batch.spans is not None and batch.sent:
            assert self._preparer.spans is not None
            sent = batch.sent
            states = [outcome.rows[i].state for i in sent]
            self._preparer.spans.end(batch.spans, [final[i] for i in sent], states, batch.delivery.acks())
        marked = batch.page.mark(batch.conn, outcome)
        batch.conn.commit()
        report_batch(self.metrics, batch, outcome, marked, acked_at)
        if marked < len(rows):
            # Our lease on some shard expired mid-batch: drain() ends (no further batch on the lost shards)
            # and _turn ticks the leases again.
            batch.delivery.mark_fenced()
            self.leases.recheck_now()
        # A batch where nothing got through (the broker is struggling) makes drain() back off.
        self._failed_batches = self._failed_batches + 1 if outcome.retried and not outcome.published else 0

    def _check_topic(self, topic: str) -> Delivery | None:
        """The topic's verdict (None: it takes messages); the leases are renewed while it waits for the
        broker's metadata."""
        known, gate = self._topics.known(topic)
        if known:
            return gate
        verdict = self.publisher.check_topic(topic, self._keep_leases)
        if verdict is None:
            self._topics.mark_good(topic)
        return verdict

    def _recheck_blocked_topics(self) -> None:
        self._topics.next_recheck = time.monotonic() + self.settings.topic_recheck_interval
        for topic in self._topics.reasons():
            if self.publisher.check_topic(topic, self._keep_leases, patient=False) is None:
                self._topics.unblock(topic)
                log.info("relay_topic_unblocked", topic=topic)
                self._release_held(topic)
        self.metrics.blocked_topics.set(len(self._topics.reasons()))

    def _refresh_held(self, owned: frozenset[int]) -> None:
        """At a lease renewal (no batch open) where shards changed hands, and every CENSUS_SECONDS: the
        aggregates held for a topic as the database has them, and the held rows of a topic that takes
        messages by now back in the queue, those of one that does not watched as blocked. A relay that
        starts, or takes shards over, finds the held rows of another here."""
        assert self._lease_conn is not None
        if owned == self._held_shards and time.monotonic() < self._next_held_reload:
            return
        self._held_shards, self._next_held_reload = owned, time.monotonic() + CENSUS_SECONDS
        self._held.load(admin.held_aggregates(self._lease_conn))
        for topic in self._held.topics() - self._topics.reasons().keys():
            verdict = self.publisher.check_topic(topic, self._keep_leases, patient=False)
            if verdict is None:
                self._release_held(topic)
            else:
                self._topics.block(topic, verdict.reason or "not usable", None)

    def _release_held(self, topic: str) -> None:
        """The topic takes messages: its held rows go back to the queue (claimed in id order, before their
        shards' logs), forgotten here first so that no new row is held for it meanwhile."""
        assert self._lease_conn is not None
        self._held.release(topic)
        requeued = admin.requeue_held(self._lease_conn, topic)
        if requeued:
            log.info("relay_held_rows_requeued", topic=topic, rows=len(requeued))

    # -- waiting -----------------------------------------------------------------------------------------

    def _wait(self, seconds: float) -> None:
        """Sleep until a NOTIFY arrives, `seconds` pass, leases need renewing, or we are asked to stop."""
        try:
            self._sleep_until_woken(seconds)
        finally:
            self._woke_at = time.time()

    def _sleep_until_woken(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.daemon.stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.leases is not None and self.leases.due()):
                return
            if self._listen_conn is None:
                self.daemon.sleep(min(remaining, 0.2))
                continue
            # Short slices keep SIGTERM handling prompt; one notification is enough to go and look.
            if any(True for _ in self._listen_conn.notifies(timeout=min(remaining, 0.5), stop_after=1)):
                return


def _all_lanes(lanes: list[Future[bool]]) -> bool:
    """Wait for every lane's thread; True when some lane's last batch was full. A lane that raised makes
    the others stop after their batch in flight (Relay._may_begin); its exception is raised here, in the
    main loop, once they have (a lost database is then handled there, like any other)."""
    wait(lanes)
    failed = next((e for e in (lane.exception() for lane in lanes) if e is not None), None)
    if failed is not None:
        raise failed
    return any(lane.result() for lane in lanes)


def _headers_as_text(conn: Connection) -> None:
    """The lane connection returns jsonb (the claim's headers) as its text, to be loaded per row by
    _begin's guarded step (load_headers): psycopg's own loader parses while the batch is fetched, where a
    value Python cannot load failed the whole batch. Once per lane connection, as it is made."""
    conn.adapters.register_loader("jsonb", TextLoader)
