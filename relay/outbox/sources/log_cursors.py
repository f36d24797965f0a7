"""Log mode's cursors: which window a lane reads next and where each shard's cursor goes after a batch.

Pure (no I/O): relay.outbox.sources.log_reader runs the SQL. A shard's cursor says which of its rows are
published: every row visible in tick `tick`'s snapshot, plus, while a window (tick, window_to] is being
read, the window's rows with id <= last_id. A lane reads one group of shards at a time: those whose
cursors stand at the same window, so that one query in id order serves them all.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, replace

from postbox.relay.outbox.outcome import RowOutcome, RowState


@dataclass(frozen=True, slots=True)
class Cursor:
    shard: int
    tick: int
    window_to: int | None = None  # None: no window open; the next one runs to the newest tick
    last_id: int | None = None  # the window's rows with id <= last_id are published
    max_id: int | None = None  # no row of the window has a higher id

    @property
    def window(self) -> tuple[int, int | None, int | None]:
        return self.tick, self.window_to, self.max_id


@dataclass(frozen=True, slots=True)
class CursorMove:
    """A batch's move of one cursor, from where the database had it when the batch began."""

    shard: int
    before: Cursor
    after: Cursor


def next_group(cursors: Sequence[Cursor]) -> list[Cursor]:
    """The cursors to read together: those at the furthest-behind window (the lowest tick). Shards at the
    same window read one query; the rest wait for the lane's next batch."""
    if not cursors:
        return []
    behind = min(cursors, key=lambda c: (c.tick, c.window_to is None, c.window_to or 0, c.shard))
    return [c for c in cursors if c.window == behind.window]


def open_window(
    group: Sequence[Cursor], window_to: int, min_id: int | None, max_id: int | None
) -> list[Cursor]:
    """The group's cursors with the window (tick, window_to] opened over ids min_id..max_id, or, when the
    window has no rows in these shards (min_id None), moved past it at once."""
    if min_id is None or max_id is None:
        return [Cursor(c.shard, window_to) for c in group]
    return [replace(c, window_to=window_to, last_id=min_id - 1, max_id=max_id) for c in group]


def first_retries(
    ids: Sequence[int], shards: Sequence[int], outcomes: Sequence[RowOutcome]
) -> dict[int, int]:
    """Per shard with a row to retry, the id of its first such row (rows in id order, one outcome each).
    A parked row is passed like a published one."""
    first: dict[int, int] = {}
    for row_id, shard, outcome in zip(ids, shards, outcomes, strict=True):
        if outcome.state is RowState.PENDING and shard not in first:
            first[shard] = row_id
    return first


def after_batch(
    group: Sequence[Cursor],
    last_read: int | None,  # the highest id the page read (None: it read none)
    first_retry: dict[int, int],  # first_retries of the page
    page_complete: bool,  # the page held every row of the window left (not cut by the limit or the bytes)
) -> list[Cursor]:
    """Where each cursor of the group stands once the batch commits.

    A shard with a row to retry stays just before that row (the rows after it are read again: duplicates
    with the same message id, never a gap). Otherwise a shard moves to the last row read, or, when the
    page completed the window, past the window to its closing tick."""
    moved: list[Cursor] = []
    for cursor in group:
        assert cursor.window_to is not None, "a batch reads an open window"
        if cursor.shard in first_retry:
            moved.append(replace(cursor, last_id=first_retry[cursor.shard] - 1))
        elif page_complete:
            moved.append(Cursor(cursor.shard, cursor.window_to))
        elif last_read is not None:
            moved.append(replace(cursor, last_id=max(cursor.last_id or 0, last_read)))
        else:
            moved.append(cursor)
    return moved


def last_ids_by_shard(group: Sequence[Cursor], shards: int = 64) -> list[int]:
    """log_read's per-shard floor, indexed by shard (rows at or below it are published)."""
    floors = [0] * shards
    for cursor in group:
        floors[cursor.shard] = cursor.last_id or 0
    return floors


# An idle shard's cursor is written at most this often. Without this, every tick rewrote every idle
# shard's cursor (64 rows, up to 100 ticks a second): while a long transaction anywhere held the
# vacuum horizon, the dead versions piled up (110,000 in 30 s at 200 events/s) and every batch's lock
# of its cursors read through them (the longtx benchmark's p99 rose by half).
IDLE_CURSOR_WRITE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class _Ahead:
    stored: Cursor  # the cursor as the database holds it
    cursor: Cursor  # where it stands: past windows without a row of this shard since `stored`
    since: float  # when it first went ahead of `stored` (monotonic seconds)


class DeferredCursors:
    """Cursor moves that pass only windows without a row of their shard, kept in memory until they are
    IDLE_CURSOR_WRITE_SECONDS old, then written with the lane's next batch.

    Safe to lose: a window without a row of the shard is such for good (both its snapshots are taken), so
    a relay that crashed, or the next owner of the shard, reads those windows again and finds nothing: no
    row is skipped and none is sent twice. A move is kept only from no open window to none: a cursor with
    a window open in the database is always written, so the database never stands mid-window where this
    relay does not. A kept move is used only while the database still holds the cursor it started from
    (another relay moving the shard, a switch of modes or a rolled-back write make it stale)."""

    def __init__(self, delay: float = IDLE_CURSOR_WRITE_SECONDS) -> None:
        self._delay = delay
        self._stored: dict[int, Cursor] = {}
        self._ahead: dict[int, _Ahead] = {}

    def load(self, stored: Sequence[Cursor]) -> list[Cursor]:
        """The cursors as read from the database (locked by this batch), each replaced by where it stands
        in memory if that is still ahead of the same stored cursor."""
        current: list[Cursor] = []
        for cursor in stored:
            self._stored[cursor.shard] = cursor
            ahead = self._ahead.get(cursor.shard)
            if ahead is not None and ahead.stored != cursor:
                del self._ahead[cursor.shard]
                ahead = None
            current.append(ahead.cursor if ahead is not None else cursor)
        return current

    def due(self, shards: Sequence[int], now: float) -> list[Cursor]:
        """The kept moves of these shards that are old enough to be written."""
        return [
            ahead.cursor
            for shard in shards
            if (ahead := self._ahead.get(shard)) is not None and ahead.since + self._delay <= now
        ]

    def all_due(self) -> list[CursorMove]:
        """Every kept move, from the cursor it started from, to be written now (a clean stop) where the
        database still holds that cursor: a shard not read since may have moved on under another owner."""
        return [CursorMove(shard, ahead.stored, ahead.cursor) for shard, ahead in self._ahead.items()]

    def keep(self, moved: Sequence[Cursor], now: float, with_rows: Set[int] = frozenset()) -> list[Cursor]:
        """Keep the moves that can wait (no row of the shard in the step, no window open before or after);
        return the ones to write now."""
        to_write: list[Cursor] = []
        for cursor in moved:
            stored = self._stored.get(cursor.shard)
            if (
                stored is None
                or cursor.shard in with_rows
                or stored.window_to is not None
                or cursor.window_to is not None
            ):
                to_write.append(cursor)
                continue
            ahead = self._ahead.get(cursor.shard)
            if cursor == stored:
                self._ahead.pop(cursor.shard, None)
            else:
                self._ahead[cursor.shard] = _Ahead(stored, cursor, ahead.since if ahead else now)
        return to_write

    def written(self, cursors: Sequence[Cursor], moved: set[int]) -> None:
        """These cursors were written in the batch's transaction; `moved` are the shards whose write held
        (the others were fenced: the database keeps what it had). Either way nothing is kept for them."""
        for cursor in cursors:
            self._ahead.pop(cursor.shard, None)
            if cursor.shard in moved:
                self._stored[cursor.shard] = cursor
