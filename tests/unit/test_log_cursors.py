"""Log mode's cursor arithmetic (relay.outbox.sources.log_cursors): which shards read together, where
cursors go."""

from __future__ import annotations

from postbox.relay.outbox.outcome import RowOutcome, RowState
from postbox.relay.outbox.sources.log_cursors import (
    Cursor,
    DeferredCursors,
    after_batch,
    first_retries,
    last_ids_by_shard,
    next_group,
    open_window,
)


def published(row_id: int) -> RowOutcome:
    return RowOutcome(row_id, RowState.PUBLISHED, None)


def test_the_group_is_the_furthest_behind_window_and_only_shards_at_exactly_that_window() -> None:
    cursors = [
        Cursor(0, 7),
        Cursor(1, 5, 9, 100, 200),
        Cursor(2, 5, 9, 150, 200),  # same window, further along: reads with shard 1
        Cursor(3, 5),  # same tick, no window open: waits
        Cursor(4, 5, 9, 10, 300),  # same ticks, other bounds (opened apart): waits
    ]
    assert [c.shard for c in next_group(cursors)] == [1, 2]
    assert next_group([]) == []
    assert [c.shard for c in next_group([Cursor(3, 5), Cursor(0, 7)])] == [3]


def test_an_empty_window_is_passed_at_once_and_a_full_one_opens_just_below_its_first_id() -> None:
    group = [Cursor(1, 5), Cursor(2, 5)]
    assert open_window(group, 9, None, None) == [Cursor(1, 9), Cursor(2, 9)]
    assert open_window(group, 9, 40, 90) == [Cursor(1, 5, 9, 39, 90), Cursor(2, 5, 9, 39, 90)]


def test_a_complete_page_moves_every_cursor_past_the_window() -> None:
    group = [Cursor(1, 5, 9, 39, 90), Cursor(2, 5, 9, 39, 90)]
    first_retry = first_retries([40, 41], [1, 2], [published(40), published(41)])
    assert first_retry == {}
    assert after_batch(group, 41, first_retry, page_complete=True) == [Cursor(1, 9), Cursor(2, 9)]


def test_a_cut_page_moves_every_cursor_of_the_group_to_the_last_row_read_even_one_without_rows() -> None:
    group = [Cursor(1, 5, 9, 39, 90), Cursor(2, 5, 9, 39, 90)]
    moved = after_batch(group, 44, {}, page_complete=False)
    assert moved == [Cursor(1, 5, 9, 44, 90), Cursor(2, 5, 9, 44, 90)], "ids read in order cover shard 2 too"


def test_a_row_to_retry_keeps_its_shard_just_before_it_and_the_others_move_on() -> None:
    group = [Cursor(1, 5, 9, 39, 90), Cursor(2, 5, 9, 39, 90)]
    rows = [(40, 1), (41, 2), (42, 1), (43, 1)]
    outcomes = [
        published(40),
        published(41),
        RowOutcome(42, RowState.PENDING, "broker down"),
        RowOutcome(43, RowState.PENDING, "held back behind an earlier failed event"),
    ]
    first_retry = first_retries([r[0] for r in rows], [r[1] for r in rows], outcomes)
    assert first_retry == {1: 42}
    assert after_batch(group, 43, first_retry, page_complete=True) == [Cursor(1, 5, 9, 41, 90), Cursor(2, 9)]


def test_a_parked_row_is_passed_like_a_published_one() -> None:
    group = [Cursor(1, 5, 9, 39, 90)]
    outcomes = [RowOutcome(40, RowState.FAILED, "message too large")]
    assert first_retries([40], [1], outcomes) == {}
    assert after_batch(group, 40, {}, page_complete=True) == [Cursor(1, 9)]


def test_the_per_shard_floors_are_indexed_by_shard() -> None:
    floors = last_ids_by_shard([Cursor(3, 5, 9, 39, 90), Cursor(63, 5, 9, 41, 90)])
    assert len(floors) == 64
    assert (floors[3], floors[63], floors[0]) == (39, 41, 0)


def test_the_shards_left_before_a_row_to_retry_are_named_and_a_parked_row_names_none() -> None:
    rows = [(40, 1), (41, 2), (42, 3)]
    outcomes = [published(40), RowOutcome(41, RowState.PENDING, "x"), RowOutcome(42, RowState.FAILED, "y")]
    assert first_retries([r[0] for r in rows], [r[1] for r in rows], outcomes) == {2: 41}


def test_an_idle_shards_moves_past_empty_windows_wait_in_memory_until_old_enough_then_are_written() -> None:
    deferred = DeferredCursors(delay=1.0)
    assert deferred.load([Cursor(1, 5), Cursor(2, 5)]) == [Cursor(1, 5), Cursor(2, 5)]
    assert deferred.keep([Cursor(1, 9), Cursor(2, 9)], now=100.0) == [], "empty windows: nothing to write"
    assert deferred.due([1, 2], now=100.5) == []
    assert [m.after for m in deferred.all_due()] == [Cursor(1, 9), Cursor(2, 9)], (
        "a clean stop writes them all"
    )
    # The next batch reads the same stored cursors and goes on from where they stand in memory.
    assert deferred.load([Cursor(1, 5), Cursor(2, 5)]) == [Cursor(1, 9), Cursor(2, 9)]
    assert deferred.keep([Cursor(1, 12)], now=100.8) == []
    assert deferred.due([1, 2], now=101.0) == [Cursor(1, 12), Cursor(2, 9)], "a second after the first move"
    deferred.written([Cursor(1, 12), Cursor(2, 9)], moved={1, 2})
    assert deferred.due([1, 2], now=200.0) == []
    assert deferred.load([Cursor(1, 12), Cursor(2, 9)]) == [Cursor(1, 12), Cursor(2, 9)]


def test_a_shard_with_rows_or_a_window_open_before_or_after_is_written_at_once() -> None:
    deferred = DeferredCursors(delay=1.0)
    deferred.load([Cursor(1, 5), Cursor(2, 5), Cursor(3, 5, 9, 40, 90)])
    moved = [Cursor(1, 9), Cursor(2, 5, 9, 44, 90), Cursor(3, 9)]
    # 1 had a row in the step; 2 stays mid-window; 3 leaves a window the database has open.
    assert deferred.keep(moved, now=0.0, with_rows={1}) == moved
    assert deferred.keep([Cursor(7, 9)], now=0.0) == [Cursor(7, 9)], "a shard never loaded is written"


def test_a_kept_move_is_dropped_when_the_database_no_longer_holds_the_cursor_it_started_from() -> None:
    deferred = DeferredCursors(delay=1.0)
    deferred.load([Cursor(1, 5)])
    deferred.keep([Cursor(1, 9)], now=0.0)
    # Another relay moved the shard on (or a switch of modes reset it): its cursor is taken as stored.
    assert deferred.load([Cursor(1, 7, 11, 50, 60)]) == [Cursor(1, 7, 11, 50, 60)]
    assert deferred.due([1], now=10.0) == []


def test_a_fenced_write_keeps_the_stored_cursor_so_a_later_kept_move_is_checked_against_it() -> None:
    deferred = DeferredCursors(delay=1.0)
    deferred.load([Cursor(1, 5), Cursor(2, 5)])
    deferred.written([Cursor(1, 9), Cursor(2, 9)], moved={1})  # shard 2's lease had lapsed
    deferred.keep([Cursor(1, 12), Cursor(2, 12)], now=0.0)
    # Shard 1's move started from the 9 written for it; shard 2's from the 5 the database kept.
    assert deferred.load([Cursor(1, 9), Cursor(2, 5)]) == [Cursor(1, 12), Cursor(2, 12)]
    # Had the batch that wrote shard 1's 9 rolled back, its kept move no longer applies.
    deferred.keep([Cursor(1, 14)], now=0.0)
    assert deferred.load([Cursor(1, 5)]) == [Cursor(1, 5)]
