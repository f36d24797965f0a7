"""The relay loop: claim a batch, publish it, mark it, commit; again while batches come back full.

What a crash at each step leaves behind:
- before the claim commits nothing changed; after produce but before the mark commits, the rows are still
  pending and their locks die with the connection, so the next owner publishes them again (a duplicate with
  the same event id, never a loss);
- the mark is one statement in the transaction that holds the row locks, fenced on the shard lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import structlog

from relay.core.backoff import backoff_delay
from relay.core.db import advisory_key
from relay.core.lifecycle import stop_on_signals
from relay.core.sql import query
from relay.outbox import admin
from relay.outbox.errors import Disposition
from relay.outbox.leases import LeaseKeeper
from relay.outbox.metrics import RelayMetrics
from relay.outbox.outcome import BatchOutcome, Delivery, decide
from relay.outbox.publisher import Publisher
from relay.outbox.routing import Message, OutboxRow, RoutingError, to_message, topic_for
from relay.outbox.settings import RelaySettings

QUERIES = Path(__file__).with_name("queries.sql")
NOTIFY_CHANNEL = "postbox_outbox"
log = structlog.get_logger("postbox.relay")

Connection = psycopg.Connection[tuple[Any, ...]]


class FatalRelayError(RuntimeError):
    """The relay cannot go on (fatal producer error); delivered rows were marked, nothing else."""


@dataclass
class TopicGate:
    """Topics known to be usable, and those held back by a configuration error with their row filter."""

    good: set[str] = field(default_factory=set)
    blocked: dict[str, str] = field(default_factory=dict)  # topic -> reason
    blocked_types: dict[str, set[str]] = field(default_factory=dict)  # topic -> aggregate types routed there
    next_recheck: float = 0.0

    def block(self, topic: str, reason: str, aggregate_type: str | None) -> None:
        if topic not in self.blocked:
            log.error("relay_topic_blocked", topic=topic, reason=reason)
        self.good.discard(topic)
        self.blocked[topic] = reason
        if aggregate_type is not None:
            self.blocked_types.setdefault(topic, set()).add(aggregate_type)

    def claim_filter(self) -> dict[str, list[str]]:
        types = sorted({t for types in self.blocked_types.values() for t in types})
        return {"blocked_topics": sorted(self.blocked), "blocked_types": types}


class Relay:
    def __init__(
        self,
        settings: RelaySettings,
        publisher: Publisher,
        metrics: RelayMetrics,
        connect: Callable[[bool], Connection],
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self.metrics = metrics
        self._connect = connect  # connect(autocommit) -> a connection with search_path set
        self._stopping = False
        self._topics = TopicGate()
        self._lock_space = advisory_key("postbox.relay", settings.schema) & 0x7FFFFFFF
        self._next_prune = 0.0
        self.last_loop = time.monotonic()
        self.connected = False
        self._batch_conn: Connection | None = None
        self._lease_conn: Connection | None = None
        self._listen_conn: Connection | None = None
        self.leases: LeaseKeeper | None = None
        self._failed_batches = 0

    # -- lifecycle -------------------------------------------------------------------------------------

    def stop(self, *_: object) -> None:
        """Ask the loop to finish the batch in flight and exit (SIGTERM, SIGINT)."""
        if not self._stopping:
            log.info("relay_stopping")
        self._stopping = True

    def install_signal_handlers(self) -> None:
        stop_on_signals(self.stop)

    def run(self) -> int:
        """Run until stopped; 0 after a clean stop. Raises FatalRelayError when the producer is broken."""
        failures = 0
        log.info(
            "relay_started",
            relay_id=self.settings.relay_id,
            schema=self.settings.schema,
            batch_size=self.settings.batch_size,
        )
        try:
            while not self._stopping:
                self.last_loop = time.monotonic()
                try:
                    self._ensure_connected()
                    full = self._turn()
                    failures = 0
                    if self.publisher.fatal_error:
                        raise FatalRelayError(self.publisher.fatal_error)
                    if not full:
                        # Inside the try: the LISTEN session can be cut while we wait, like any other.
                        self._wait(self.settings.poll_interval)
                except psycopg.Error as exc:
                    if not self._connection_lost(exc):
                        raise  # a bug or a schema problem: fail loudly rather than loop on it
                    failures += 1
                    delay = backoff_delay(failures)
                    log.warning(
                        "relay_database_unavailable", error=str(exc).strip(), retry_in=round(delay, 2)
                    )
                    self._disconnect()
                    self._sleep(delay)
        finally:
            self._shutdown()
        log.info("relay_stopped", relay_id=self.settings.relay_id)
        return 0

    def _connection_lost(self, exc: psycopg.Error) -> bool:
        """Whether `exc` means the server went away (restart, failover, a session timeout), not a bug."""
        if isinstance(exc, psycopg.OperationalError):
            return True
        return any(
            conn is not None and conn.broken
            for conn in (self._batch_conn, self._lease_conn, self._listen_conn)
        )

    def _ensure_connected(self) -> None:
        if self._batch_conn is not None and self._lease_conn is not None:
            return
        self._batch_conn = self._connect(False)
        self._lease_conn = self._connect(True)
        if self.settings.listen:
            # Its own connection, used for nothing else, so no notification is consumed by another query.
            self._listen_conn = self._connect(True)
            self._listen_conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        self.leases = LeaseKeeper(self._lease_conn, self.settings.relay_id, self.settings.lease_ttl)
        self.connected = True
        log.info("relay_connected")

    def _disconnect(self) -> None:
        self.connected = False
        for conn in (self._batch_conn, self._lease_conn, self._listen_conn):
            if conn is not None:
                conn.close()
        self._batch_conn = self._lease_conn = self._listen_conn = None
        self.leases = None

    def _shutdown(self) -> None:
        self.publisher.close(self.settings.delivery_timeout)
        if self.leases is not None:
            try:
                self.leases.release_all()
            except psycopg.Error as exc:  # the leases then simply expire; nothing is lost either way
                log.warning("relay_release_failed", error=str(exc).strip())
        self._disconnect()

    def healthy(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self.last_loop
        limit = max(60.0, 2 * self.settings.delivery_timeout + 30)
        return (stalled < limit, f"main loop last turned {stalled:.1f}s ago (limit {limit:.0f}s)")

    def ready(self) -> tuple[bool, str]:
        if not self.connected:
            return False, "not connected to PostgreSQL"
        if self.publisher.fatal_error:
            return False, self.publisher.fatal_error
        if self._topics.blocked:
            return False, "blocked topics: " + ", ".join(
                f"{t} ({r})" for t, r in self._topics.blocked.items()
            )
        if self.leases is None or not self.leases.owned:
            return False, "owns no shard yet"
        return True, f"ok: {len(self.leases.owned)} shards"

    # -- one turn of the loop --------------------------------------------------------------------------

    def _turn(self) -> bool:
        """Maintain leases, maybe prune, run one batch. True when the batch came back full."""
        assert self.leases is not None
        if self.leases.due():
            owned = self.leases.tick()
            self.metrics.shards_owned.set(len(owned))
            self.metrics.leases_lost.inc(self.leases.lost_in_last_tick)
            self._refresh_backlog_gauges()
        if self._topics.blocked and time.monotonic() >= self._topics.next_recheck:
            self._recheck_blocked_topics()
        self._maybe_prune()
        self.metrics.ready.set(1 if self.ready()[0] else 0)
        if not self.leases.owned:
            return False
        return self.run_batch() >= self.settings.batch_size

    def run_batch(self) -> int:
        """Claim, publish and mark one batch in one transaction; returns the number of rows claimed."""
        conn, leases = self._batch_conn, self.leases
        assert conn is not None
        assert leases is not None
        started = time.perf_counter()
        with conn.transaction():
            claim_params = {
                "shards": sorted(leases.owned),
                "lock_space": self._lock_space,
                "limit": self.settings.batch_size,
                **self._topics.claim_filter(),
            }
            rows = [OutboxRow(*r) for r in conn.execute(query(QUERIES, "claim_batch"), claim_params)]
            if not rows:
                return 0
            outcome = self._publish(rows, leases.renew_only)
            marked = conn.execute(
                query(QUERIES, "mark_batch"),
                {
                    "relay_id": self.settings.relay_id,
                    "ids": [o.row_id for o in outcome.rows],
                    "states": [o.state for o in outcome.rows],
                    "errors": [o.error for o in outcome.rows],
                },
            ).rowcount
        self._record(rows, outcome, marked, time.perf_counter() - started)
        return len(rows)

    def _publish(self, rows: list[OutboxRow], while_waiting: Callable[[], None]) -> BatchOutcome:
        template = self.settings.topic_template
        deliveries: list[Delivery | None] = [None] * len(rows)
        topics = [topic_for(row, template) for row in rows]
        to_send: list[tuple[int, Message]] = []
        # One verdict per distinct topic per batch: a metadata check can wait, and it runs inside the
        # batch transaction.
        verdicts: dict[str, Delivery | None] = {}
        for index, (row, topic) in enumerate(zip(rows, topics, strict=True)):
            if topic not in verdicts:
                verdicts[topic] = self._check_topic(topic, while_waiting)
            gate = verdicts[topic]
            if gate is not None:
                deliveries[index] = gate
                continue
            try:
                to_send.append((index, to_message(row, template, self.settings.event_type_header)))
            except RoutingError as exc:
                deliveries[index] = Delivery(Disposition.PARK, str(exc))
        if to_send:
            results = self.publisher.publish([m for _, m in to_send], while_waiting)
            for (index, _), result in zip(to_send, results, strict=True):
                deliveries[index] = result
        final = [d if d is not None else Delivery(Disposition.RETRY, "not sent") for d in deliveries]
        outcome = decide([r.id for r in rows], [r.aggregate_id for r in rows], topics, final)
        for index, delivery in enumerate(final):
            if delivery.disposition is Disposition.TOPIC_BLOCKED:
                row = rows[index]
                self._topics.block(
                    topics[index], delivery.reason or "", None if row.topic else row.aggregate_type
                )
        self.metrics.blocked_topics.set(len(self._topics.blocked))
        return outcome

    def _check_topic(self, topic: str, while_waiting: Callable[[], None]) -> Delivery | None:
        if topic in self._topics.good:
            return None
        if topic in self._topics.blocked:
            return Delivery(Disposition.TOPIC_BLOCKED, self._topics.blocked[topic])
        verdict = self.publisher.check_topic(topic, while_waiting)
        if verdict is None:
            self._topics.good.add(topic)
        return verdict

    def _recheck_blocked_topics(self) -> None:
        self._topics.next_recheck = time.monotonic() + self.settings.topic_recheck_interval
        for topic in list(self._topics.blocked):
            assert self.leases is not None
            if self.publisher.check_topic(topic, self.leases.renew_only, patient=False) is None:
                del self._topics.blocked[topic]
                self._topics.blocked_types.pop(topic, None)
                log.info("relay_topic_unblocked", topic=topic)
        self.metrics.blocked_topics.set(len(self._topics.blocked))

    def _record(self, rows: list[OutboxRow], outcome: BatchOutcome, marked: int, seconds: float) -> None:
        template = self.settings.topic_template
        by_id = {row.id: row for row in rows}
        acked_at = time.time()
        for row_outcome in outcome.rows:
            row = by_id[row_outcome.row_id]
            topic = topic_for(row, template)
            if row_outcome.state == "published":
                self.metrics.published.labels(topic).inc()
                # Wall clock against the database's created_at: comparable while the clocks are in sync.
                self.metrics.commit_to_ack.observe(max(0.0, acked_at - row.created_epoch))
            elif row_outcome.state == "failed":
                self.metrics.parked.labels(topic).inc()
                log.error(
                    "relay_row_parked", row_id=row_outcome.row_id, topic=topic, reason=row_outcome.error
                )
        self.metrics.retried.inc(outcome.retried)
        self.metrics.batch_rows.observe(len(rows))
        self.metrics.batch_seconds.observe(seconds)
        if marked < len(outcome.rows):
            # Our lease on some shard expired mid-batch: its rows stay pending for the new owner (duplicates).
            self.metrics.fenced.inc(len(outcome.rows) - marked)
            log.warning("relay_mark_fenced", unmarked=len(outcome.rows) - marked)
        if outcome.retried:
            log.warning(
                "relay_rows_retried",
                count=outcome.retried,
                reason=next((o.error for o in outcome.rows if o.state == "pending"), None),
            )
        log.debug(
            "relay_batch_published",
            rows=len(rows),
            published=outcome.published,
            parked=outcome.parked,
            retried=outcome.retried,
            seconds=round(seconds, 4),
        )
        if outcome.retried and not outcome.published:
            # Nothing got through: the broker is struggling. Back off longer after each such batch.
            self._failed_batches += 1
            self._sleep(backoff_delay(self._failed_batches))
        else:
            self._failed_batches = 0

    def _refresh_backlog_gauges(self) -> None:
        assert self._lease_conn is not None
        current = admin.status(self._lease_conn)
        self.metrics.backlog_rows.set(current.backlog)
        self.metrics.oldest_pending_seconds.set(current.oldest_pending_seconds)
        self.metrics.parked_rows.set(current.parked)
        self.metrics.unowned_shards.set(current.unowned_shards)

    def _maybe_prune(self) -> None:
        retention = self.settings.prune_retention
        if retention is None or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + self.settings.prune_interval
        assert self._batch_conn is not None
        deleted = admin.prune(self._batch_conn, retention, batch_size=1000, max_batches=10)
        if deleted:
            log.info("relay_pruned", rows=deleted, retention_seconds=retention / timedelta(seconds=1))

    # -- waiting -----------------------------------------------------------------------------------------

    def _wait(self, seconds: float) -> None:
        """Sleep until a NOTIFY arrives, `seconds` pass, leases need renewing, or we are asked to stop."""
        deadline = time.monotonic() + seconds
        while not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.leases is not None and self.leases.due()):
                return
            if self._listen_conn is None:
                time.sleep(min(remaining, 0.2))
                continue
            # Short slices keep SIGTERM handling prompt; one notification is enough to go and look.
            if any(True for _ in self._listen_conn.notifies(timeout=min(remaining, 0.5), stop_after=1)):
                return

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(min(0.2, deadline - time.monotonic()))
