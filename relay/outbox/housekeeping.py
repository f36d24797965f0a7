"""The relay's housekeeping: the backlog gauges and census, its source's upkeep (the log's gauges and tick
pruning), partition upkeep and --prune-retention's pruning. On a connection and a thread of their own, off
the lanes' path.

Why a thread: this work used to run at each lease turn, where every lane waits for it. It took 17-70 ms a
turn (the census alone 18-56 ms), every few seconds, which was most of the relay's latency tail at 1,000
events/s (tests/bench/first_minute.py). None of it decides what a lane does: its statements read, or keep
partitions with short lock timeouts (outbox_maintain_partitions), so it runs beside the lanes.

An error is never swallowed: the thread stops and `check()` raises it in the relay's main loop, which
handles it as it handles its own (a lost database: reconnect and start a new Housekeeping; anything else
stops the relay).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import psycopg
import structlog

from postbox.relay.outbox import admin
from postbox.relay.outbox.metrics import RelayMetrics

log = structlog.get_logger("postbox.relay")
Connection = psycopg.Connection[tuple[Any, ...]]

CENSUS_SECONDS = 10.0  # the least seconds between two censuses
# Rows per prune transaction, and transactions per round: a round stays short, so a stop is prompt.
PRUNE_BATCH_ROWS = 1000
PRUNE_BATCHES_PER_ROUND = 10


class Steps:
    """Wall-clock start and milliseconds per step of a round of work, for its debug line."""

    def __init__(self) -> None:
        self.began_at = time.time()
        self.ms: dict[str, float] = {}
        self._mark = time.perf_counter()

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.ms[step] = round((now - self._mark) * 1000, 1)
        self._mark = now


class Housekeeping:
    """One relay connection's housekeeping thread: `start()` once, `check()` from the main loop, `stop()`
    before the relay disconnects. A Housekeeping that stopped (or failed) is not started again: the relay
    makes a new one with its next connections."""

    def __init__(
        self,
        connect: Callable[[bool], Connection],
        metrics: RelayMetrics,
        *,
        interval: float,
        partition_xids: int,
        prune_retention: timedelta | None,
        prune_interval: float,
        source_upkeep: Callable[[Connection], None],
    ) -> None:
        self._connect = connect
        self.metrics = metrics
        self.interval = interval
        self._partition_xids = partition_xids
        self._prune_retention = prune_retention
        self._prune_interval = prune_interval
        self._source_upkeep = source_upkeep  # the source read now: a relay with --mode auto may swap it
        self.conn: Connection | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="relay-housekeeping", daemon=True)
        self._next_census = 0.0  # when the census may be taken again (monotonic)
        self._census: admin.Status | None = None  # the last status with a census
        self._stranded_seen = 0  # logged once per change
        self._next_prune = 0.0
        self.last_round = time.monotonic()  # when the last round ended (or the thread started)

    def start(self) -> None:
        self.last_round = time.monotonic()
        self._thread.start()

    def check(self) -> None:
        """Raise the error that stopped the thread, in the caller's thread (the relay's main loop)."""
        if self._error is not None:
            raise self._error

    def stalled_for(self) -> float:
        """Seconds since the last round ended, beyond what its interval allows (0 when on time)."""
        if self._error is not None or not self._thread.is_alive():
            return 0.0
        return max(0.0, time.monotonic() - self.last_round - self.interval)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the statement in progress (the thread closes its connection). One that outlasts
        `timeout` (a database cut off without a word) is asked to cancel, and the thread is left to end
        on its own: it is a daemon thread that only writes gauges and upkeep its successor repeats."""
        self._stopping.set()
        if not self._thread.is_alive():
            return
        self._thread.join(timeout)
        conn = self.conn
        if self._thread.is_alive() and conn is not None:
            try:
                conn.cancel_safe(timeout=timeout)
            except psycopg.Error as exc:
                log.warning("relay_housekeeping_cancel_failed", error=type(exc).__name__)

    def _run(self) -> None:
        try:
            self.conn = self._connect(True)
            while not self._stopping.is_set():
                self.run_once(self.conn)
                self.last_round = time.monotonic()
                self._stopping.wait(self.interval)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main loop, by check()
            self._error = exc
        finally:
            if self.conn is not None:
                self.conn.close()

    def run_once(self, conn: Connection) -> None:
        """One round: gauges (with the census when due), the source's upkeep, partitions, pruning when due."""
        steps = Steps()
        self._backlog_gauges(conn)
        steps.done("gauges")
        self._source_upkeep(conn)
        steps.done("source")
        self.keep_partitions(conn)
        steps.done("partitions")
        if self._prune_retention is not None and time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self._prune_interval
            self._prune(conn, self._prune_retention)
            steps.done("prune")
        log.debug("relay_housekeeping", began_at=steps.began_at, ms=steps.ms)

    def keep_partitions(self, conn: Connection) -> None:
        """Create the outbox's partitions ahead and mark finished ones (each round, and by the relay once
        as it connects, before its first batch: a relay never publishes with no partition ahead)."""
        upkeep = admin.maintain_partitions(conn, self._partition_xids, None)
        if upkeep.changed:
            log.info("relay_partitions_maintained", created=upkeep.created, done=upkeep.done)

    def _backlog_gauges(self, conn: Connection) -> None:
        # The census (stranded rows, the log's unread ones) reads every partition, and every unread row:
        # at most every CENSUS_SECONDS, and on a large backlog at most about 2% of this connection's
        # time. Its statements also lock every partition, which each time makes pruning's drop of a
        # finished partition wait. The figures shown meanwhile are the last census's.
        census = time.monotonic() >= self._next_census
        started = time.monotonic()
        current = admin.status(conn, census=census)
        if census:
            taken = time.monotonic() - started
            log.debug("relay_census", ms=round(taken * 1000, 1))
            self._census = current
            self._next_census = time.monotonic() + max(CENSUS_SECONDS, 50 * taken)
        stranded = self._census.stranded if self._census else None
        current = replace(current, stranded=stranded, log=self._census.log if self._census else None)
        self.metrics.backlog_rows.set(current.backlog)
        self.metrics.oldest_pending_seconds.set(current.oldest_unpublished_seconds)
        if stranded is not None:
            self._report_stranded(stranded)
        self.metrics.failed_rows.set(current.failed)
        self.metrics.unowned_shards.set(current.unowned_shards)
        self.metrics.outbox_partitions.labels("finished").set(current.partitions_finished)
        self.metrics.outbox_partitions.labels("in_use").set(current.partitions - current.partitions_finished)

    def _report_stranded(self, stranded: admin.Stranded) -> None:
        self.metrics.stranded_rows.set(stranded.rows)
        if stranded.rows != self._stranded_seen:  # logged once per change
            self._stranded_seen = stranded.rows
            if stranded.rows:
                log.error(
                    "relay_rows_stranded",
                    rows=stranded.rows,
                    first_ids=stranded.first_ids,
                    help="`postbox relay status` names them; `postbox relay requeue --stranded` queues them",
                )

    def _prune(self, conn: Connection, retention: timedelta) -> None:
        pruned = admin.prune(
            conn, retention, batch_size=PRUNE_BATCH_ROWS, max_batches=PRUNE_BATCHES_PER_ROUND
        )
        if pruned.rows or pruned.partitions.changed:
            log.info(
                "relay_pruned",
                rows=pruned.rows,
                partitions_emptied=pruned.partitions.emptied,
                partitions_dropped=pruned.partitions.dropped,
                parked_moved=pruned.partitions.parked_moved,
                retention_seconds=retention / timedelta(seconds=1),
            )
