"""Log mode's cursor arithmetic (relay.outbox.log): which shards read together, where cursors go."""

from __future__ import annotations

from relay.outbox.log import (
    Cursor,
    after_batch,
    last_ids_by_shard,
    next_group,
    open_window,
    retried_shards,
)
from relay.outbox.outcome import RowOutcome, RowState


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
    rows = [(40, 1), (41, 2)]
    assert after_batch(group, rows, [published(40), published(41)], page_complete=True) == [
        Cursor(1, 9),
        Cursor(2, 9),
    ]


def test_a_cut_page_moves_every_cursor_of_the_group_to_the_last_row_read_even_one_without_rows() -> None:
    group = [Cursor(1, 5, 9, 39, 90), Cursor(2, 5, 9, 39, 90)]
    moved = after_batch(group, [(40, 1), (44, 1)], [published(40), published(44)], page_complete=False)
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
    assert after_batch(group, rows, outcomes, page_complete=True) == [Cursor(1, 5, 9, 41, 90), Cursor(2, 9)]


def test_a_parked_row_is_passed_like_a_published_one() -> None:
    group = [Cursor(1, 5, 9, 39, 90)]
    outcomes = [RowOutcome(40, RowState.FAILED, "message too large")]
    assert after_batch(group, [(40, 1)], outcomes, page_complete=True) == [Cursor(1, 9)]


def test_the_per_shard_floors_are_indexed_by_shard() -> None:
    floors = last_ids_by_shard([Cursor(3, 5, 9, 39, 90), Cursor(63, 5, 9, 41, 90)])
    assert len(floors) == 64
    assert (floors[3], floors[63], floors[0]) == (39, 41, 0)


def test_the_shards_left_before_a_row_to_retry_are_named_and_a_parked_row_names_none() -> None:
    rows = [(40, 1), (41, 2), (42, 3)]
    outcomes = [published(40), RowOutcome(41, RowState.PENDING, "x"), RowOutcome(42, RowState.FAILED, "y")]
    assert retried_shards(rows, outcomes) == {2}
