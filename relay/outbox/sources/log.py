"""Log mode's source: each shard's cursor reads the outbox in commit order, window by window between
ticks (log_reader.py beside it has the SQL side, log_cursors.py the pure logic). A lane whose shards have
pending rows (from before a switch to log mode, or requeued) claims those first, as queue mode does: the
SQL orders a shard's pending and logged rows by the last switch of modes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

from postbox.relay.outbox import admin
from postbox.relay.outbox.exactly_once.groups import group_of
from postbox.relay.outbox.exactly_once.settlement import Settlement
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import BatchOutcome, RowOutcome, RowState
from postbox.relay.outbox.settings import LOG_BATCH_ROWS
from postbox.relay.outbox.sources.base import Connection, OutboxRecord, Page, ReadLimits
from postbox.relay.outbox.sources.log_cursors import CursorMove
from postbox.relay.outbox.sources.log_reader import LogPage, LogReader, prune_ticks
from postbox.relay.outbox.sources.queue import Claimer


@dataclass
class WindowPage:
    """A page of a window of the log: its cursors move past it when it is marked."""

    records: list[OutboxRecord]
    window: LogPage
    reader: LogReader

    @property
    def claimed(self) -> int:
        return int(self.records[0].claimed_rows)

    @property
    def read_past(self) -> bool:
        return True

    def mark(self, conn: Connection, outcome: BatchOutcome) -> int:
        ids = [r.id for r in self.records]
        shards = [r.shard for r in self.records]
        return self.reader.finish(conn, self.window, ids, shards, outcome)

    def settlements(self, groups: Collection[int], outcome: BatchOutcome) -> dict[int, Settlement]:
        ids = [r.id for r in self.records]
        shards = [r.shard for r in self.records]
        moves: dict[int, list[CursorMove]] = {g: [] for g in groups}
        for move in self.reader.moves(self.window, ids, shards, outcome):
            if (group := group_of(move.shard)) in moves:
                moves[group].append(move)
        parked: dict[int, list[RowOutcome]] = {g: [] for g in groups}
        if outcome.failed:
            for row, shard in zip(outcome.rows, shards, strict=True):
                if row.state is RowState.FAILED and (group := group_of(shard)) in parked:
                    parked[group].append(row)
        relay_id = self.reader.relay_id
        return {g: Settlement(g, relay_id, moves=tuple(moves[g]), parked=tuple(parked[g])) for g in groups}


class LogSource:
    name = "log"

    def __init__(
        self,
        claimer: Claimer,
        batch_size: int | None,
        *,
        schema: str,
        tick_interval: float,
        tick_conn: Callable[[], Connection],
        tick_lock: threading.Lock,
        metrics: RelayMetrics,
    ) -> None:
        """tick_conn: the connection ticks are taken on (the relay's lease connection, shared with other
        threads under tick_lock)."""
        self._claimer = claimer
        self.rows_per_batch = batch_size or LOG_BATCH_ROWS
        self._reader = LogReader(schema, claimer.relay_id, tick_interval, tick_lock)
        self._tick_conn = tick_conn
        self._metrics = metrics
        self._closed = False

    def read(self, conn: Connection, lane: list[int], limits: ReadLimits) -> Page | None:
        # The claim runs only when the lane has pending rows (rare), which spares the common batch a
        # statement.
        locked = self._reader.lock(conn, lane)
        if locked.pending:
            claimed = self._claimer.claim(conn, lane, limits)
            if claimed is not None:
                return claimed
        read = self._reader.read(conn, self._tick_conn(), locked, limits)
        return None if read is None else WindowPage(read[0], read[1], self._reader)

    def look_again_in(self) -> float | None:
        return self._reader.look_again_in()

    def upkeep(self, conn: Connection) -> None:
        """Delete the ticks every cursor has passed; the log's gauges."""
        prune_ticks(conn)
        progress = admin.log_progress(conn)
        self._metrics.log_tick_age_seconds.set(progress.tick_age_seconds)
        self._metrics.log_oldest_open_transaction_seconds.set(progress.oldest_open_transaction_seconds)
        if not self._closed:  # not once the relay followed the outbox to queue mode (close cleared them)
            for shard, lag in progress.cursor_lag_seconds.items():
                self._metrics.log_cursor_lag_seconds.labels(str(shard)).set(lag)

    def close(self, conn: Connection) -> None:
        """Write the cursor moves kept in memory, so that `postbox relay status` shows where the log stands;
        clear the cursor lag, kept by log-mode relays only."""
        self._closed = True
        self._reader.write_deferred(conn)
        self._metrics.log_cursor_lag_seconds.clear()
