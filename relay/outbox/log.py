"""Log mode's cursors: which window a lane reads next and where each shard's cursor goes after a batch.

Pure (no I/O): relay.outbox.log_reader runs the SQL. A shard's cursor says which of its rows are
published: every row visible in tick `tick`'s snapshot, plus, while a window (tick, window_to] is being
read, the window's rows with id <= last_id. A lane reads one group of shards at a time: those whose
cursors stand at the same window, so that one query in id order serves them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from relay.outbox.outcome import RowOutcome, RowState


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


def after_batch(
    group: Sequence[Cursor],
    rows: Sequence[tuple[int, int]],  # (id, shard) of each row read, in id order
    outcomes: Sequence[RowOutcome],  # one per row, same order
    page_complete: bool,  # the page held every row of the window left (not cut by the limit or the bytes)
) -> list[Cursor]:
    """Where each cursor of the group stands once the batch commits.

    A shard with a row to retry stays just before that row (the rows after it are read again: duplicates
    with the same message id, never a gap). Otherwise a shard moves to the last row read, or, when the
    page completed the window, past the window to its closing tick."""
    first_retry: dict[int, int] = {}
    for (row_id, shard), outcome in zip(rows, outcomes, strict=True):
        if outcome.state is RowState.PENDING and shard not in first_retry:
            first_retry[shard] = row_id
    last_read = rows[-1][0] if rows else None
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


def retried_shards(rows: Sequence[tuple[int, int]], outcomes: Sequence[RowOutcome]) -> set[int]:
    """The shards whose cursor a batch left before a row to retry."""
    return {shard for (_, shard), o in zip(rows, outcomes, strict=True) if o.state is RowState.PENDING}
