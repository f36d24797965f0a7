"""Log mode's reads and cursor writes (--mode log): the SQL side of log_cursors.py beside it.

A batch: lock the lane's cursors (so a shard is in one open batch at a time), take where they stand in
memory when they only passed windows without their rows since (log_cursors.DeferredCursors), pick
the group at the furthest-behind window, open a window to the newest tick if none is open (taking a tick
when the newest is older than --tick-interval), read the next page of rows in id order, publish it, then
move the cursors in the batch's transaction, fenced on the shard leases. A crash before that commit
leaves the cursors where they were: the page is read and published again (duplicates, same message ids).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.db import advisory_key
from postbox.relay.core.sql import query
from postbox.relay.outbox.outcome import BatchOutcome, RowState
from postbox.relay.outbox.sources.base import OutboxRecord, ReadLimits, outbox_records
from postbox.relay.outbox.sources.log_cursors import (
    Cursor,
    CursorMove,
    DeferredCursors,
    after_batch,
    first_retries,
    last_ids_by_shard,
    next_group,
    open_window,
)

QUERIES = Path(__file__).parent.parent / "queries.sql"  # relay/outbox/queries.sql
Connection = psycopg.Connection[tuple[Any, ...]]


class OutboxModeError(RuntimeError):
    """The relay's --mode does not match the outbox's (see `postbox relay switch-mode`)."""


@dataclass(frozen=True)
class Snapshots:
    prev: str  # the window's opening tick's snapshot (text form)
    prev_xmax: str
    prev_xip: list[str]
    cur: str  # its closing tick's
    cur_xmax: str
    prev_xmin: str


@dataclass(frozen=True)
class LockedLane:
    """A lane's cursors as locked by its batch, with what the same statement read alongside."""

    cursors: list[Cursor]  # as stored; shards held by another batch or waiting for pending rows left out
    latest_tick: int | None
    pending: bool  # some shard of the lane has pending rows (claimed before the log is read)


@dataclass
class LogPage:
    """A page of a window, read in the batch's transaction, for the mark step."""

    group: list[Cursor]
    complete: bool  # the page held every row left in the window
    stored: list[Cursor]  # the group's cursors as committed when the batch began (its locked rows)


def outbox_in_log_mode(conn: Connection) -> bool:
    found = conn.execute(query(QUERIES, "log_mode_of_outbox")).fetchone()
    return bool(found and found[0])


def shards_behind_switch(conn: Connection) -> int:
    """After a switch back to queue mode: the shards whose log is not yet read to the switch."""
    found = conn.execute(query(QUERIES, "log_behind_switch")).fetchone()
    return int(found[0]) if found else 0


def log_started(conn: Connection) -> bool:
    """Whether the outbox was ever switched to log mode (its cursors have a tick)."""
    found = conn.execute(query(QUERIES, "log_started")).fetchone()
    return bool(found and found[0])


def advance_from(conn: Connection, relay_id: str, moves: Sequence[CursorMove]) -> list[int]:
    """Each move's cursor moved where it still stands where the move started (and its shard is leased to
    `relay_id`): the shards moved. For moves made outside the batch that locked the cursor: a clean stop's
    kept moves, an exactly-once settlement written back."""
    rows = conn.execute(
        query(QUERIES, "settle_cursors"),
        {
            "relay_id": relay_id,
            "shards": [m.shard for m in moves],
            **_cursor_arrays([m.before for m in moves], "from_"),
            **_cursor_arrays([m.after for m in moves]),
        },
    ).fetchall()
    return [int(r[0]) for r in rows]


def _cursor_arrays(cursors: Sequence[Cursor], prefix: str = "") -> dict[str, list[int | None]]:
    """The cursors' positions as the array parameters log_advance and settle_cursors take."""
    return {
        f"{prefix}ticks": [c.tick for c in cursors],
        f"{prefix}window_tos": [c.window_to for c in cursors],
        f"{prefix}last_ids": [c.last_id for c in cursors],
        f"{prefix}max_ids": [c.max_id for c in cursors],
    }


def prune_ticks(conn: Connection) -> None:
    """Delete the ticks every cursor has passed (autocommit connection)."""
    conn.execute(query(QUERIES, "log_prune_ticks"))


def take_tick(conn: Connection, schema: str, min_age: float, *, wait: bool) -> tuple[bool, int | None]:
    """A new tick, unless one younger than min_age exists: whether one was taken, and the newest tick
    now. `conn` is in autocommit mode. Without `wait`, none is taken while another session holds the tick
    lock (see log_try_tick_lock): it is taking one, or it stopped mid-tick and is about to be fenced."""
    key = {"key": advisory_key("postbox.tick", schema)}
    with conn.transaction():
        if not wait:
            locked = conn.execute(query(QUERIES, "log_try_tick_lock"), key).fetchone()
            if not (locked and locked[0]):
                found = conn.execute(query(QUERIES, "log_newest_tick")).fetchone()
                return False, _int_or_none(found[0]) if found else None
        else:
            conn.execute(query(QUERIES, "log_tick_lock"), key)
        row = conn.execute(
            query(QUERIES, "log_take_tick"), {"min_age": timedelta(seconds=min_age)}
        ).fetchone()
    assert row is not None
    taken, newest = _int_or_none(row[0]), _int_or_none(row[1])
    return taken is not None, taken if taken is not None else newest


class LogReader:
    def __init__(
        self, schema: str, relay_id: str, tick_interval: float, tick_lock: threading.Lock | None = None
    ) -> None:
        """tick_lock: held while a tick is taken on the tick connection, which other threads (the relay's
        other lanes, its lease renewals) use too; a tick is a transaction no other statement may join.
        The lanes' threads share this reader, each on shards of its own."""
        self._schema = schema
        self._relay_id = relay_id
        self._tick_interval = tick_interval
        self._tick_lock = tick_lock or threading.Lock()
        self._snapshots: dict[tuple[int, int], Snapshots] = {}  # ticks never change
        # A shard whose cursor stopped before a row to retry (a broker error, a topic held back) rests,
        # backing off per consecutive failure: it cannot pass that row, and reading it again at once
        # would starve the lane's other shards (the furthest-behind window is read first) and send its
        # later rows again and again.
        self._failures: dict[int, int] = {}
        self._rest_until: dict[int, float] = {}
        self._deferred = DeferredCursors()
        self._look_again_at: float | None = None

    @property
    def relay_id(self) -> str:
        return self._relay_id

    def lock(self, conn: Connection, lane: list[int]) -> LockedLane:
        """Lock the lane's cursors in the batch's transaction on `conn` (see log_lock_cursors)."""
        found = conn.execute(query(QUERIES, "log_lock_cursors"), {"shards": lane}).fetchall()
        if not found:
            # No cursor to read (every shard waits for its pending rows, or another batch holds them):
            # whether pending rows wait is not known, so the claim runs.
            return LockedLane([], None, pending=True)
        cursors = [Cursor(int(r[0]), int(r[1]), *map(_int_or_none, r[2:5])) for r in found]
        return LockedLane(cursors, _int_or_none(found[0][5]), pending=bool(found[0][6]))

    def read(
        self, conn: Connection, tick_conn: Connection, locked: LockedLane, limits: ReadLimits
    ) -> tuple[list[OutboxRecord], LogPage] | None:
        """The next page for the locked cursors, in the open transaction on `conn`, or None when every
        window is read to the newest tick (cursors moved past empty windows are written, not committed).
        `limits`: the page's rows and byte budget."""
        now = time.monotonic()
        current = self._deferred.load(locked.cursors)
        self._write(conn, self._deferred.due([c.shard for c in locked.cursors], now))
        cursors = {c.shard: c for c in current if self._rest_until.get(c.shard, 0.0) <= now}
        latest = locked.latest_tick
        for _ in range(4):  # empty windows are passed at once; a few per batch keeps the batch short
            group = next_group(list(cursors.values()))
            if not group:
                return None
            if group[0].window_to is None:
                opened, latest = self._open(conn, tick_conn, group, latest)
                if opened is None:
                    return None  # at the newest tick: nothing committed since
                group = opened
                if group[0].window_to is None:  # an empty window: passed
                    self._write(conn, self._deferred.keep(group, now))
                    cursors.update((c.shard, c) for c in group)
                    continue
            snapshots = self._window(conn, group[0])
            floors = last_ids_by_shard(group)
            with conn.cursor(row_factory=outbox_records) as cursor:
                rows = cursor.execute(
                    query(QUERIES, "log_read"),
                    {
                        **limits.params(),
                        "shards": [c.shard for c in group],
                        "from_id": min(floors[c.shard] for c in group),
                        "max_id": group[0].max_id,
                        "last_ids": floors,
                        "cur": snapshots.cur,
                        "prev": snapshots.prev,
                        "prev_xmin": snapshots.prev_xmin,
                        "cur_xmax": snapshots.cur_xmax,
                    },
                ).fetchall()
            if not rows:  # the window is read: its closing tick is where the group stands now
                passed = [Cursor(c.shard, c.window_to) for c in group if c.window_to is not None]
                self._write(conn, self._deferred.keep(passed, now))
                cursors.update((c.shard, c) for c in passed)
                continue
            claimed = rows[0].claimed_rows
            complete = claimed < limits.rows and claimed == len(rows)
            stored = {c.shard: c for c in locked.cursors}
            return rows, LogPage(group, complete, [stored[c.shard] for c in group])
        return None

    def write_deferred(self, conn: Connection) -> None:
        """Write every cursor move kept in memory (on a clean stop, while the leases are still ours), so
        that the database shows how far the log is read: `postbox relay status`, the cursor lag and a
        switch back to queue mode go by it. `conn` is in autocommit mode."""
        moves = self._deferred.all_due()
        if not moves:
            return
        moved = advance_from(conn, self._relay_id, moves)
        self._deferred.written([m.after for m in moves], set(moved))

    def look_again_in(self) -> float | None:
        """Seconds until the relay should read again although nothing woke it, once after a read found no
        new tick because the newest was younger than --tick-interval: a row whose NOTIFY woke that read
        committed after the newest tick's snapshot, and would otherwise wait for the next wake-up (the
        poll interval, when no other row commits)."""
        if self._look_again_at is None:
            return None
        seconds, self._look_again_at = max(0.0, self._look_again_at - time.monotonic()), None
        return seconds

    def _open(
        self, conn: Connection, tick_conn: Connection, group: list[Cursor], latest: int | None
    ) -> tuple[list[Cursor] | None, int | None]:
        """The group's window opened to the newest tick (taking one if the newest known, `latest`, is
        where the group stands), or None if at the newest already; and the newest tick now known."""
        tick = group[0].tick
        if latest is None or latest <= tick:
            with self._tick_lock:
                taken, latest = take_tick(tick_conn, self._schema, self._tick_interval, wait=False)
            if latest is None or latest <= tick:
                if not taken:
                    self._look_again_at = time.monotonic() + self._tick_interval
                return None, latest
        snapshots = self._snapshots_of(conn, tick, latest)
        bounds = conn.execute(
            query(QUERIES, "log_window_bounds"),
            {
                "prev_xmax": snapshots.prev_xmax,
                "prev_xip": snapshots.prev_xip,
                "cur_xmax": snapshots.cur_xmax,
                "cur": snapshots.cur,
                "shards": [c.shard for c in group],
            },
        ).fetchone()
        assert bounds is not None
        return open_window(group, latest, _int_or_none(bounds[0]), _int_or_none(bounds[1])), latest

    def _window(self, conn: Connection, cursor: Cursor) -> Snapshots:
        assert cursor.window_to is not None
        return self._snapshots_of(conn, cursor.tick, cursor.window_to)

    def _snapshots_of(self, conn: Connection, tick: int, window_to: int) -> Snapshots:
        key = (tick, window_to)
        known = self._snapshots.get(key)  # one lookup: another lane may clear the cache meanwhile
        if known is None:
            found = conn.execute(
                query(QUERIES, "log_snapshots"), {"tick": tick, "window_to": window_to}
            ).fetchone()
            if found is None:
                raise RuntimeError(f"log mode: tick {tick} or {window_to} is gone (deleted by hand?)")
            if len(self._snapshots) > 256:
                self._snapshots.clear()
            known = self._snapshots[key] = Snapshots(
                str(found[0]), str(found[1]), list(found[2]), str(found[3]), str(found[4]), str(found[5])
            )
        return known

    def finish(
        self,
        conn: Connection,
        page: LogPage,
        ids: Sequence[int],
        shards: Sequence[int],
        outcome: BatchOutcome,
    ) -> int:
        """Park the rows that can never be published and move the group's cursors, in the batch's
        transaction (not committed here). `ids` and `shards` are the page's rows', in id order, and
        `outcome.rows` has one outcome each. Returns the rows whose shard was still ours (fence)."""
        if outcome.failed:
            parked = [o for o in outcome.rows if o.state is RowState.FAILED]
            conn.execute(
                query(QUERIES, "log_park"),
                {
                    "relay_id": self._relay_id,
                    "ids": [o.row_id for o in parked],
                    "errors": [o.error for o in parked],
                    "held_for": [o.held_for for o in parked],
                },
            )
        first_retry = self._first_retries(ids, shards, outcome)
        moved = after_batch(page.group, ids[-1] if ids else None, first_retry, page.complete)
        rows_per_shard = Counter(shards)
        held = set(self._write(conn, self._deferred.keep(moved, time.monotonic(), rows_per_shard.keys())))
        for cursor in page.group:
            if cursor.shard in first_retry:
                failures = self._failures[cursor.shard] = self._failures.get(cursor.shard, 0) + 1
                self._rest_until[cursor.shard] = time.monotonic() + backoff_delay(failures, cap=10.0)
            else:
                self._failures.pop(cursor.shard, None)
                self._rest_until.pop(cursor.shard, None)
        return sum(rows_per_shard[shard] for shard in held)

    def moves(
        self, page: LogPage, ids: Sequence[int], shards: Sequence[int], outcome: BatchOutcome
    ) -> list[CursorMove]:
        """Where finish() will move the group's cursors, each from where the database had it when the
        batch began (exactly-once carries them in the batch's transaction). Pure."""
        first_retry = self._first_retries(ids, shards, outcome)
        moved = after_batch(page.group, ids[-1] if ids else None, first_retry, page.complete)
        with_rows = set(shards)
        return [
            CursorMove(c.shard, before, c)
            for before, c in zip(page.stored, moved, strict=True)
            # A move past windows without a row of its shard, and none open, may be lost (DeferredCursors
            # keeps such moves in memory): left out, so a write-back is only ever a batch's rows.
            if c.shard in with_rows or before.window_to is not None or c.window_to is not None
        ]

    @staticmethod
    def _first_retries(ids: Sequence[int], shards: Sequence[int], outcome: BatchOutcome) -> dict[int, int]:
        # Looked for only when some row is retried: the usual batch has none, and skips a pass per row.
        return first_retries(ids, shards, outcome.rows) if outcome.retried else {}

    def _write(self, conn: Connection, cursors: Sequence[Cursor]) -> list[int]:
        """Move these cursors (fenced); the shards whose cursor moved."""
        if not cursors:
            return []
        moved = conn.execute(
            query(QUERIES, "log_advance"),
            {"relay_id": self._relay_id, "shards": [c.shard for c in cursors], **_cursor_arrays(cursors)},
        ).fetchall()
        shards = [int(r[0]) for r in moved]
        self._deferred.written(cursors, set(shards))
        return shards


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(str(value))
