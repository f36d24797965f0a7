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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import structlog
import tenacity
from psycopg.types.string import TextLoader

from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from postbox.relay.core.db import advisory_key, describe_error, transient_database_error
from postbox.relay.core.sql import query
from postbox.relay.core.tracing import TRACING_OFF, Tracing
from postbox.relay.outbox import admin
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.held import HeldAggregates
from postbox.relay.outbox.housekeeping import CENSUS_SECONDS, Housekeeping, Steps
from postbox.relay.outbox.lane_turns import LaneTurns
from postbox.relay.outbox.leases import LeaseKeeper
from postbox.relay.outbox.log_reader import (
    LogPage,
    LogReader,
    log_started,
    outbox_in_log_mode,
    shards_behind_switch,
)
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import BatchOutcome, Delivery, RowState, decide
from postbox.relay.outbox.publisher import Publisher, Sending
from postbox.relay.outbox.routing import (
    Message,
    OutboxRow,
    RoutingError,
    TopicRoutes,
    load_headers,
    raised_in,
    to_message,
    unpreparable_reason,
)
from postbox.relay.outbox.settings import RelaySettings, mode_to_follow
from postbox.relay.outbox.shares import split_lanes

if TYPE_CHECKING:
    from postbox.relay.outbox.tracing import PublishSpans

QUERIES = Path(__file__).with_name("queries.sql")
NOTIFY_CHANNEL = "postbox_outbox"
# The topic label of a row whose topic is no legal name: a writer's arbitrary text is no metric label.
UNROUTABLE = "(unroutable)"
log = structlog.get_logger("postbox.relay")
_ID, _AGGREGATE_ID, _SHARD = attrgetter("id"), attrgetter("aggregate_id"), attrgetter("shard")
HELD_IN_SHARD = Delivery(Disposition.RETRY, "held back behind an earlier row of its shard (log mode)")

Connection = psycopg.Connection[tuple[Any, ...]]


class FatalRelayError(RuntimeError):
    """The relay cannot go on (fatal producer error); delivered rows were marked, nothing else."""


class RelayIdInUse(RuntimeError):
    """Another live replica is connected with this relay id; this one waits until it is gone."""


class RelayConfigurationError(RuntimeError):
    """A setting the database cannot honour, found once connected and before anything is claimed."""


@dataclass
class TopicGate:
    """Topics known to be usable, and those held back by a configuration error with their row filter.

    Lanes read and change it from their threads, and /readyz reads it from the ops server's: every change
    and every walk over it holds the lock."""

    good: set[str] = field(default_factory=set)
    blocked: dict[str, str] = field(default_factory=dict)  # topic -> reason
    blocked_types: dict[str, set[str]] = field(default_factory=dict)  # topic -> aggregate types routed there
    next_recheck: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def block(self, topic: str, reason: str, aggregate_type: str | None) -> None:
        with self._lock:
            if topic not in self.blocked:
                log.error("relay_topic_blocked", topic=topic, reason=reason)
            self.good.discard(topic)
            self.blocked[topic] = reason
            if aggregate_type is not None:
                self.blocked_types.setdefault(topic, set()).add(aggregate_type)

    def unblock(self, topic: str) -> None:
        with self._lock:
            self.blocked.pop(topic, None)
            self.blocked_types.pop(topic, None)

    def known(self, topic: str) -> tuple[bool, Delivery | None]:
        """(whether the topic is known, and then None when it is good, else why it is blocked)."""
        with self._lock:
            if topic in self.good:
                return True, None
            reason = self.blocked.get(topic)
        return (False, None) if reason is None else (True, Delivery(Disposition.TOPIC_BLOCKED, reason))

    def mark_good(self, topic: str) -> None:
        with self._lock:
            if len(self.good) >= 4096:  # writers choose topics: a bounded memory, checked again when cleared
                self.good.clear()
            self.good.add(topic)

    def reasons(self) -> dict[str, str]:
        with self._lock:
            return dict(self.blocked)

    def claim_filter(self) -> dict[str, list[str]]:
        with self._lock:
            types = sorted({t for types in self.blocked_types.values() for t in types})
            return {"blocked_topics": sorted(self.blocked), "blocked_types": types}


@dataclass
class InFlight:
    """A claimed batch whose messages are with the producer; its transaction stays open until the mark."""

    conn: Connection
    lane: list[int]
    rows: list[OutboxRow]
    topics: list[str]
    deliveries: list[Delivery | None]  # known before sending: blocked topics, rows that cannot be routed
    sent: list[int]  # indexes into rows of the messages handed to the producer
    sending: Sending | None
    started: float
    claimed: int  # rows the claim took: len(rows), or more when the byte budget cut the batch short
    # Wall-clock times (time.time()) of its stages, for the stage metrics and the latency breakdown:
    # the wake-up it began after (a NOTIFY, a poll, or the previous batch), and the end of its claim.
    woke_at: float = 0.0
    claimed_at: float = 0.0
    claim_seconds: float = 0.0
    spans: list[Any] | None = None  # one publish span per message sent, when tracing is on
    log_page: LogPage | None = None  # log mode: the window page these rows came from (else a claim)


class Relay:
    def __init__(
        self,
        settings: RelaySettings,
        publisher: Publisher,
        metrics: RelayMetrics,
        connect: Callable[[bool], Connection],
        tracing: Tracing = TRACING_OFF,
    ) -> None:
        self.settings = settings
        self._requested = settings  # as given: --mode auto is resolved into self.settings (_follow)
        self.publisher = publisher
        self.metrics = metrics
        self._connect = connect  # connect(autocommit) -> a connection with search_path set
        # A batch legitimately waits up to the delivery timeout for its acks, twice over with two lanes.
        self.daemon = Daemon(
            "relay", stall_limit=max(60.0, 2 * settings.delivery_timeout + 30), backoff=self._backoff
        )
        self._topics = TopicGate()
        self._held = HeldAggregates()  # log mode: aggregates waiting for a blocked topic
        self._held_shards: frozenset[int] | None = None  # the shards owned when it was last loaded
        self._next_held_reload = 0.0
        self._routes = TopicRoutes(settings.topic_template)
        self._lock_space = advisory_key("postbox.relay", settings.schema) & 0x7FFFFFFF
        self._housekeeping: Housekeeping | None = None  # gauges, census, partitions, pruning: own thread
        self.connected = False
        self._batch_conns: list[Connection] = []  # one per lane
        self._lease_conn: Connection | None = None
        self._listen_conn: Connection | None = None
        self.leases: LeaseKeeper | None = None
        self._failed_batches = 0
        self._woke_at = 0.0  # wall clock: when the last wait ended (a NOTIFY, the poll interval, a stop)
        self._waiting_for_id: str | None = None  # why we wait: another replica holds our relay id
        self._broker_trouble: tuple[float, str] | None = None  # as last seen by the main loop
        self._spans: PublishSpans | None = None
        # The lease connection serves every lane: renewing while a batch waits, and log mode's ticks (a
        # transaction of two statements, which another lane's statement must not join).
        self._lease_lock = threading.Lock()
        self._lane_pool: ThreadPoolExecutor | None = None  # with more than one lane: a thread per lane
        self._lane_failed = threading.Event()  # a lane raised: the others finish their batch and stop
        self._log = (
            LogReader(settings.schema, settings.relay_id, settings.tick_interval, self._lease_lock)
            if settings.mode == "log"
            else None
        )
        if tracing.tracer is not None:  # imported only then: OpenTelemetry is an optional dependency
            from postbox.relay.outbox.tracing import PublishSpans  # noqa: PLC0415

            self._spans = PublishSpans(tracing.tracer, tracing.follows_parent)

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
            # With --mode auto and no --batch-size: logged by relay_mode_followed once the mode is known.
            batch_size=None if self.settings.mode == "auto" else self.settings.rows_per_batch,
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
            again = self._log.look_again_in() if self._log is not None else None
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
        self._lock_relay_id(self._lease_conn)
        self._waiting_for_id = None
        self._check_mode(self._lease_conn)
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
        self.leases = LeaseKeeper(self._lease_conn, self.settings.relay_id, self.settings.lease_ttl)
        self._housekeeping = Housekeeping(
            self._connect,
            self.metrics,
            interval=self.settings.lease_ttl / 3,  # as often as leases are renewed
            partition_xids=self.settings.partition_xids,
            prune_retention=self.settings.prune_retention,
            prune_interval=self.settings.prune_interval,
            log_mode=lambda: self._log is not None,
        )
        self._housekeeping.start()
        self.connected = True
        log.info("relay_connected")

    def _check_mode(self, conn: Connection) -> None:
        """At every connect and lease tick (no batch open). --mode auto: follow the outbox's mode, which
        after a switch back to queue mode is log mode until every shard's log is read to the switch. A
        pinned mode: refuse one that would leave rows unread (a queue relay on a log-mode outbox never
        reads the log; a log relay on an outbox never switched has no cursors). A switch waits only for
        open batches, so an idle relay, or one cut off from the database, finds it here."""
        foreign = admin.foreign_log(conn)
        if foreign is not None:
            raise RelayConfigurationError(foreign)
        in_log_mode = outbox_in_log_mode(conn)
        started = log_started(conn)
        behind = shards_behind_switch(conn) if started else 0
        if self._requested.mode == "auto":
            read_to_switch = started and not in_log_mode and self._log is not None
            self._follow(
                mode_to_follow(in_log_mode, behind),
                "the log is read to the switch back" if read_to_switch else "the outbox's mode",
            )
        if in_log_mode and self._log is None:
            raise RelayConfigurationError(
                "the outbox is in log mode: run the relay with --mode log or auto (POSTBOX_RELAY_MODE), or "
                "switch the outbox back first (postbox relay switch-mode queue)"
            )
        if self._log is not None and not in_log_mode and not started:
            raise RelayConfigurationError(
                "--mode log: the outbox is in queue mode; switch it first (postbox relay switch-mode log)"
            )
        if self._log is None and behind:
            raise RelayConfigurationError(
                f"the outbox was switched back to queue mode, but the log of {behind} shards is not read "
                "to the switch yet: run the relays with --mode log or auto until `postbox relay status` "
                "shows it read"
            )

    def _follow(self, mode: str, reason: str) -> None:
        """Run in `mode` from the next batch on (--mode auto; called with no batch open: at a connect or
        a lease tick)."""
        if mode == self.settings.mode:
            return
        self.settings = self._requested.following(mode)
        if mode == "log":
            self._log = LogReader(
                self.settings.schema, self.settings.relay_id, self.settings.tick_interval, self._lease_lock
            )
        else:
            if self._log is not None and self._lease_conn is not None:
                self._log.write_deferred(self._lease_conn)  # so that status shows where the log stands
            self._log = None
            self.metrics.log_cursor_lag_seconds.clear()  # kept by log-mode relays only
        log.info("relay_mode_followed", mode=mode, batch_size=self.settings.rows_per_batch, reason=reason)

    def _lock_relay_id(self, conn: Connection) -> None:
        """Hold the relay id's session lock on the lease connection, or raise RelayIdInUse."""
        key = advisory_key("postbox.relay-id", f"{self.settings.schema}:{self.settings.relay_id}")

        def lock() -> bool:
            locked = conn.execute(query(QUERIES, "lock_relay_id"), {"key": key}).fetchone()
            return bool(locked and locked[0])

        if lock():
            return
        ended = conn.execute(
            query(QUERIES, "end_stale_relay_id_holder"),
            {
                "high": (key >> 32) & 0xFFFFFFFF,
                "low": key & 0xFFFFFFFF,
                "relay_id": self.settings.relay_id,
                "ttl": timedelta(seconds=self.settings.lease_ttl),
            },
        ).fetchone()
        if ended and ended[0]:
            log.warning("relay_stale_session_ended", relay_id=self.settings.relay_id)
            # A terminated backend releases its locks as it exits: look again for up to about 2 s.
            again = tenacity.Retrying(
                retry=tenacity.retry_if_result(lambda locked: not locked),
                stop=tenacity.stop_after_attempt(9),
                wait=tenacity.wait_fixed(0.2),
                retry_error_callback=lambda _state: False,
            )
            if again(lock):
                return
        raise RelayIdInUse(
            f"another relay is connected with relay-id {self.settings.relay_id!r}; give each replica "
            "its own (the default, hostname-pid, is unique). Waiting for it to go away."
        )

    def _disconnect(self) -> None:
        self.connected = False
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
        if self.leases is not None:
            try:
                if self._log is not None and self._lease_conn is not None:
                    self._log.write_deferred(self._lease_conn)
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
            self.metrics.leases_lost.inc(self.leases.lost_in_last_tick)
            assert self._lease_conn is not None
            self._check_mode(self._lease_conn)
            steps.done("check_mode")
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
        lanes = list(
            zip(
                self._batch_conns,
                split_lanes(sorted(self.leases.owned), len(self._batch_conns)),
                strict=False,
            )
        )
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
                # Rows may be waiting: the claim hit its row limit, or the byte budget cut it short.
                full = batch.claimed >= self.settings.rows_per_batch or batch.claimed > len(batch.rows)
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
        """Claim up to batch-size rows of the lane's shards (opening the batch's transaction) and hand
        their messages to the producer; None, with the transaction closed, when there is nothing to do."""
        assert self.leases is not None
        started = time.perf_counter()
        max_message = self.settings.max_message_bytes
        claim_params = {
            "shards": lane,
            "lock_space": self._lock_space,
            "limit": self.settings.rows_per_batch,
            "max_message_bytes": max_message,
            "max_batch_bytes": self.settings.max_batch_bytes,
            **self._topics.claim_filter(),
        }
        woke_at = self._woke_at
        result, log_page = self._claim(conn, lane, claim_params)
        claimed_at, claim_seconds = time.time(), time.perf_counter() - started
        if not result:
            # Ends the transaction, and with it the shards' locks; log mode keeps the cursors it moved
            # past empty windows.
            conn.commit()
            return None
        claimed = int(result[0][-1])  # rows the claim took; more than len(rows) when cut at the byte budget
        rows, topics, deliveries, sent, messages = self._prepare(result, log_page, max_message)
        spans = None
        if self._spans is not None and messages:
            spans, messages = self._start_spans(rows, sent, messages, deliveries)
        sending = self.publisher.send(messages, record_acks=spans is not None) if messages else None
        return InFlight(
            conn,
            lane,
            rows,
            topics,
            deliveries,
            sent,
            sending,
            started,
            claimed,
            woke_at,
            claimed_at,
            claim_seconds,
            spans,
            log_page,
        )

    def _prepare(
        self, result: list[tuple[Any, ...]], log_page: LogPage | None, max_message: int
    ) -> tuple[list[OutboxRow], list[str], list[Delivery | None], list[int], list[Message]]:
        """The claimed records as rows, each row's topic, what is known of each row before sending (parked,
        held back, a blocked topic; None for a row to send), and the messages to send with their rows'
        indexes."""
        make, routes, type_header = OutboxRow._make, self._routes, self.settings.event_type_header
        held = self._held
        rows: list[OutboxRow] = []
        topics: list[str] = []
        deliveries: list[Delivery | None] = []  # known before sending: why a row is not sent
        sent: list[int] = []
        messages: list[Message] = []
        # One verdict per distinct topic per batch: a metadata check can wait, and it runs inside the
        # batch transaction.
        verdicts: dict[str, Delivery | None] = {}
        # Log mode: a shard's cursor cannot pass a row held back before sending, so its later rows in this
        # page are not sent either (they would be read and sent again with it).
        held_shards: set[int] = set()
        for index, record in enumerate(result):
            # The row's preparation, one guarded step: whatever a writer stored, any exception while
            # turning the row into a message (headers, size, routing, templating, encoding) parks this row
            # alone, with a reason that quotes none of its contents. The record is the claim's: its
            # headers are still JSON text (loaded here, not by the fetch).
            try:
                headers = record[7]
                if headers is None:
                    row = make(record[:-1])
                else:
                    row = make((*record[:7], load_headers(headers), *record[8:-1]))
                if row.size > max_message:  # its payload was never loaded (see claim_batch)
                    raise RoutingError(
                        f"message too large: {row.size} bytes, over the producer's message.max.bytes "
                        f"({max_message}); not loaded"
                    )
                topic = routes.topic(row)
                message = to_message(row, topic, type_header)
            except Exception as exc:  # noqa: BLE001 - the row is parked whatever it raised
                row = make((*record[:7], None, *record[8:-1]))
                rows.append(row)
                topics.append(UNROUTABLE)
                deliveries.append(_unpreparable(row, exc))
                continue
            rows.append(row)
            topics.append(topic)
            if log_page is not None:
                # Log mode holds an aggregate, not its shard, while its events wait for a topic.
                waits = held.waits_for(row.shard, row.aggregate_id)
                if waits is not None:
                    deliveries.append(Delivery(Disposition.HOLD, _held_behind(waits), waits))
                    continue
            if row.shard in held_shards:
                deliveries.append(HELD_IN_SHARD)
                continue
            if topic not in verdicts:
                verdicts[topic] = self._check_topic(topic, self._keep_leases)
            gate = verdicts[topic]
            if gate is not None and log_page is not None and gate.disposition is Disposition.TOPIC_BLOCKED:
                held.hold(row.shard, row.aggregate_id, topic)
                deliveries.append(Delivery(Disposition.HOLD, f"held: {gate.reason}", topic))
                continue
            deliveries.append(gate)
            if gate is not None:
                if log_page is not None:
                    held_shards.add(row.shard)
                continue
            messages.append(message)
            sent.append(index)
        return rows, topics, deliveries, sent, messages

    def _start_spans(
        self,
        rows: list[OutboxRow],
        sent: list[int],
        messages: list[Message],
        deliveries: list[Delivery | None],
    ) -> tuple[list[Any], list[Message]]:
        """A publish span per message (tracing on), the last part of a row's preparation: it needs the
        topic's verdict, so it runs after the batch's guarded step, under the same rule (a row whose span
        cannot be started is parked and not sent). `sent` is trimmed in place to the messages returned."""
        assert self._spans is not None
        spans: list[Any] = []
        kept: list[Message] = []
        kept_rows: list[int] = []
        for index, message in zip(sent, messages, strict=True):
            try:
                spans.append(self._spans.start((rows[index],), (message,))[0])
            except Exception as exc:  # noqa: BLE001 - the row is parked whatever it raised
                deliveries[index] = _unpreparable(rows[index], exc)
                continue
            kept.append(message)
            kept_rows.append(index)
        sent[:] = kept_rows
        return spans, kept

    def _claim(
        self, conn: Connection, lane: list[int], params: dict[str, Any]
    ) -> tuple[list[tuple[Any, ...]], LogPage | None]:
        """The batch's rows: claimed pending rows, or in log mode when there are none the next page of the
        log. Which of a shard's rows are older, its pending or its logged ones, the SQL decides from the
        last switch of modes (migration 0006's outbox_mode), in the statement that reads them."""
        if self._log is None:
            return conn.execute(query(QUERIES, "claim_batch"), params).fetchall(), None
        # Log mode: the claim runs only when the lane has pending rows (rare: from before a switch, or
        # requeued), which spares the common batch a statement.
        locked = self._log.lock(conn, lane)
        if locked.pending:
            claimed = conn.execute(query(QUERIES, "claim_batch"), params).fetchall()
            if claimed:
                return claimed, None
        assert self._lease_conn is not None
        read = self._log.read(conn, self._lease_conn, locked, params)
        return (read[0], read[1]) if read is not None else ([], None)

    def _finish(self, batch: InFlight) -> None:
        """Wait for the batch's delivery reports, mark its rows in its transaction, commit."""
        assert self.leases is not None
        deliveries = batch.deliveries
        if batch.sending is not None:
            reports = batch.sending.wait(self._keep_leases)
            for index, report in zip(batch.sent, reports, strict=True):
                deliveries[index] = report
        acked_at = time.time()
        final = [d if d is not None else Delivery(Disposition.RETRY, "not sent") for d in deliveries]
        rows = batch.rows
        ids = list(map(_ID, rows))  # map with an attrgetter: about half a list comprehension's cost
        outcome = decide(ids, list(map(_AGGREGATE_ID, rows)), final)
        if batch.spans is not None and batch.sending is not None:
            assert self._spans is not None
            sent = batch.sent
            states = [outcome.rows[i].state for i in sent]
            self._spans.end(batch.spans, [final[i] for i in sent], states, batch.sending.acks())
        for index, delivery in enumerate(final):
            if delivery.disposition is Disposition.TOPIC_BLOCKED or (
                delivery.disposition is Disposition.HOLD and delivery.held_for == batch.topics[index]
            ):
                row = rows[index]
                self._topics.block(
                    batch.topics[index], delivery.reason or "", None if row.topic else row.aggregate_type
                )
        self.metrics.blocked_topics.set(len(self._topics.reasons()))
        if batch.log_page is not None:
            assert self._log is not None
            marked = self._log.finish(batch.conn, batch.log_page, ids, list(map(_SHARD, rows)), outcome)
        else:
            marked = batch.conn.execute(
                query(QUERIES, "mark_batch_deleting" if self.settings.delete_on_publish else "mark_batch"),
                {
                    "relay_id": self.settings.relay_id,
                    "ids": [o.row_id for o in outcome.rows],
                    "states": [o.state.value for o in outcome.rows],
                    "errors": [o.error for o in outcome.rows],
                },
            ).rowcount
        batch.conn.commit()
        self._record(batch, outcome, marked, acked_at)

    def _check_topic(self, topic: str, while_waiting: Callable[[], None]) -> Delivery | None:
        known, gate = self._topics.known(topic)
        if known:
            return gate
        verdict = self.publisher.check_topic(topic, while_waiting)
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

    def _record(self, batch: InFlight, outcome: BatchOutcome, marked: int, acked_at: float) -> None:
        committed_at = time.time()
        seconds = time.perf_counter() - batch.started
        stages = self.metrics.batch_stage_seconds
        stages.labels("claim").observe(batch.claim_seconds)
        stages.labels("publish").observe(max(0.0, acked_at - batch.claimed_at))
        stages.labels("mark").observe(max(0.0, committed_at - acked_at))
        # Wall clock against the database's created_at: comparable while the clocks are in sync.
        if outcome.published == len(batch.rows):  # the usual batch: counted without a look at each row
            published = Counter(batch.topics)
            self.metrics.commit_to_ack.observe_many(
                [max(0.0, acked_at - row.created_epoch) for row in batch.rows]
            )
        else:
            published = Counter()
            waited: list[float] = []
            # outcome.rows is in the order of batch.rows (decide keeps it).
            for row, topic, row_outcome in zip(batch.rows, batch.topics, outcome.rows, strict=True):
                if row_outcome.state is RowState.PUBLISHED:
                    published[topic] += 1
                    waited.append(max(0.0, acked_at - row.created_epoch))
                elif row_outcome.state is RowState.FAILED:
                    self.metrics.failed.labels(self.metrics.topic_label(topic)).inc()
                    log.error(
                        "relay_row_parked", row_id=row_outcome.row_id, topic=topic, reason=row_outcome.error
                    )
            self.metrics.commit_to_ack.observe_many(waited)
        for topic, count in published.items():
            self.metrics.published.labels(self.metrics.topic_label(topic)).inc(count)
        self.metrics.retried.inc(outcome.retried)
        self.metrics.batch_rows.observe(len(batch.rows))
        self.metrics.batch_seconds.observe(seconds)
        if marked < len(batch.rows):
            # Our lease on some shard expired mid-batch: its rows stay pending for the new owner (duplicates).
            self.metrics.fenced.inc(len(batch.rows) - marked)
            log.warning("relay_mark_fenced", unmarked=len(batch.rows) - marked)
            assert self.leases is not None
            self.leases.recheck_now()  # no further batch on the lost shards: drain() ends, _turn re-ticks
        if outcome.retried:
            log.warning(
                "relay_rows_retried",
                count=outcome.retried,
                reason=next((o.error for o in outcome.rows if o.state is RowState.PENDING), None),
            )
        if log.is_enabled_for(logging.DEBUG):  # its arguments (a list of the batch's ids) cost even unlogged
            log.debug(
                "relay_batch_published",
                rows=len(batch.rows),
                published=outcome.published,
                failed=outcome.failed,
                retried=outcome.retried,
                seconds=round(seconds, 4),
                # Wall-clock stage times and the rows, for tests/bench's latency breakdown (debug only).
                woke_at=batch.woke_at,
                claim_started_at=batch.claimed_at - batch.claim_seconds,
                claimed_at=batch.claimed_at,
                acked_at=acked_at,
                committed_at=committed_at,
                row_ids=list(map(_ID, batch.rows)),
            )
        # A batch where nothing got through (the broker is struggling) makes drain() back off.
        self._failed_batches = self._failed_batches + 1 if outcome.retried and not outcome.published else 0

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


def _unpreparable(row: OutboxRow, exc: Exception) -> Delivery:
    """The fate of a row whose preparation raised `exc`: parked. An exception other than a RoutingError (the
    expected kind, whose reason says it all) is logged by its class and where it was raised, never its
    message, which may quote the row's contents."""
    if not isinstance(exc, RoutingError):
        log.warning("relay_row_unpreparable", row_id=row.id, error=type(exc).__name__, where=raised_in(exc))
    return Delivery(Disposition.PARK, unpreparable_reason(exc))


def _headers_as_text(conn: Connection) -> None:
    """The lane connection returns jsonb (the claim's headers) as its text, to be loaded per row by
    _begin's guarded step (load_headers): psycopg's own loader parses while the batch is fetched, where a
    value Python cannot load failed the whole batch. Once per lane connection, as it is made."""
    conn.adapters.register_loader("jsonb", TextLoader)


def _held_behind(topic: str) -> str:
    return f"held behind an earlier event of its aggregate, which waits for topic {topic}"
