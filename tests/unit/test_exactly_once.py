"""Exactly-once publication's pure parts (relay.outbox.exactly_once.groups and .settlement): which shards
form a group, what a batch's settlement records and reads back as, which of a batch's rows go into its
transaction; and the relay settings that --exactly-once checks at start."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postbox.relay.core.settings import SettingsError
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.exactly_once.groups import (
    GROUP_COUNT,
    GROUP_SHARDS,
    group_of,
    groups_in,
    partial_shards,
    shards_of,
    split_groups,
    whole_groups,
)
from postbox.relay.outbox.exactly_once.settlement import (
    HELD_IN_SHARD,
    REASON_CHARS,
    TRIED_ALONE,
    Plan,
    Settlement,
    SettlementError,
    decode,
    plan,
)
from postbox.relay.outbox.outcome import DELIVERED, Delivery, RowOutcome, RowState
from postbox.relay.outbox.settings import RelaySettings
from postbox.relay.outbox.shares import SHARD_COUNT, split_lanes
from postbox.relay.outbox.sources.log_cursors import Cursor, CursorMove

PUBLISHED, PENDING, FAILED = RowState.PUBLISHED, RowState.PENDING, RowState.FAILED
PARK = Delivery(Disposition.PARK, "Broker: Message size too large")
RETRY = Delivery(Disposition.RETRY, "Local: Message timed out")
HOLD = Delivery(Disposition.HOLD, "held: Broker: Unknown topic or partition", "orders")
BLOCKED = Delivery(Disposition.TOPIC_BLOCKED, "Broker: Topic authorization failed")


def relay_settings(**overrides: Any) -> RelaySettings:
    return RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", **overrides)


def states(planned: Plan) -> list[RowState]:
    return [row.state for row in planned.outcome.rows]


def errors(planned: Plan) -> list[str | None]:
    return [row.error for row in planned.outcome.rows]


# -- groups -----------------------------------------------------------------------------------------------


def test_the_shards_split_into_eight_groups_of_eight() -> None:
    assert GROUP_SHARDS == 8
    assert GROUP_COUNT == 8
    assert GROUP_COUNT * GROUP_SHARDS == SHARD_COUNT


def test_a_shard_belongs_to_the_group_of_its_run_of_eight() -> None:
    assert [group_of(s) for s in (0, 7, 8, 15, 16, 62, 63)] == [0, 0, 1, 1, 2, 7, 7]
    assert shards_of(0) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert shards_of(7) == list(range(56, 64))


def test_every_shard_is_in_exactly_one_group_and_its_group_holds_it() -> None:
    seen = [s for g in range(GROUP_COUNT) for s in shards_of(g)]
    assert seen == list(range(SHARD_COUNT))
    for group in range(GROUP_COUNT):
        assert {group_of(s) for s in shards_of(group)} == {group}


def test_whole_groups_are_those_all_of_whose_shards_are_owned_in_order() -> None:
    assert whole_groups(range(SHARD_COUNT)) == list(range(GROUP_COUNT))
    assert whole_groups([]) == []
    # Group 1 whole, group 0 missing shard 3, group 7 whole, given out of order and with duplicates.
    owned = [63, *range(56, 63), 0, 1, 2, 4, 5, 6, 7, *range(8, 16), 9, 9]
    assert whole_groups(owned) == [1, 7]
    assert whole_groups(iter(range(8, 16))) == [1]  # any iterable, read once


def test_partial_shards_are_those_whose_group_is_not_wholly_owned_sorted() -> None:
    owned = [*range(8, 16), 33, 0, 63, 1]
    assert partial_shards(owned) == [0, 1, 33, 63]
    assert partial_shards(range(SHARD_COUNT)) == []
    assert partial_shards([]) == []
    assert partial_shards(iter([5, *range(16, 24)])) == [5]


@settings(max_examples=300, deadline=None)
@given(owned=st.sets(st.integers(0, SHARD_COUNT - 1)))
def test_whole_groups_and_partial_shards_split_the_owned_shards(owned: set[int]) -> None:
    whole = whole_groups(owned)
    partial = partial_shards(owned)
    whole_shards = {s for g in whole for s in shards_of(g)}
    assert whole_shards | set(partial) == owned
    assert not whole_shards & set(partial)
    assert partial == sorted(partial)
    assert set(whole) <= set(groups_in(owned))
    assert {group_of(s) for s in partial}.isdisjoint(whole)


def test_groups_in_names_each_group_touched_once_sorted() -> None:
    assert groups_in([9, 0, 63, 8, 1]) == [0, 1, 7]
    assert groups_in([]) == []
    assert groups_in(iter([40])) == [5]


def test_split_groups_deals_whole_groups_into_lanes_as_shard_lists() -> None:
    assert split_groups([3, 1, 2], 2) == [
        [*shards_of(1), *shards_of(3)],
        shards_of(2),
    ]
    assert split_groups([5], 1) == [shards_of(5)]
    assert split_groups([4, 0], 8) == [shards_of(0), shards_of(4)]  # no empty lane
    assert split_groups([], 3) == []


@settings(max_examples=200, deadline=None)
@given(groups=st.sets(st.integers(0, GROUP_COUNT - 1)), lanes=st.integers(1, 8))
def test_split_groups_never_splits_a_group_and_places_every_shard_once(groups: set[int], lanes: int) -> None:
    dealt = split_groups(sorted(groups, reverse=True), lanes)
    assert len(dealt) == min(lanes, len(groups))
    assert all(dealt)
    every = [s for lane in dealt for s in lane]
    assert sorted(every) == sorted(s for g in groups for s in shards_of(g))
    for lane in dealt:
        assert whole_groups(lane) == groups_in(lane)  # each lane is whole groups only
    # The groups of different lanes never meet.
    lane_groups = [set(groups_in(lane)) for lane in dealt]
    assert sum(map(len, lane_groups)) == len(groups)
    # Dealt like split_lanes deals shards, a group standing for its shards.
    assert [groups_in(lane) for lane in dealt] == split_lanes(sorted(groups), lanes)


# -- the settlement record --------------------------------------------------------------------------------


def _settlement() -> Settlement:
    return Settlement(
        group=3,
        relay_id="relay-a:1",
        outbox="0a1b2c3d-e5f6/16384",
        moves=(
            CursorMove(24, Cursor(24, 7), Cursor(24, 7, 9, 120, 300)),  # a window opened from none
            CursorMove(25, Cursor(25, 5, 9, 10, 300), Cursor(25, 9)),  # a window passed: back to None
            CursorMove(26, Cursor(26, 9), Cursor(26, 9)),  # unmoved
        ),
        parked=(
            RowOutcome(5, FAILED, "Broker: Message size too large"),
            RowOutcome(7, FAILED, "Broker: Message size too large"),
            RowOutcome(6, FAILED, "held: Broker: Unknown topic or partition", "orders"),
        ),
        marked=(
            RowOutcome(8, PUBLISHED, None),
            RowOutcome(10, PUBLISHED, None),
            RowOutcome(9, FAILED, "bad headers"),
        ),
    )


def test_a_settlement_reads_back_as_it_was_written() -> None:
    written = _settlement()
    value = written.encode()
    assert isinstance(value, bytes)
    assert decode(value) == written


def test_cursor_fields_that_are_none_read_back_as_none() -> None:
    move = CursorMove(0, Cursor(0, 1, None, None, None), Cursor(0, 2, 3, None, 5))
    back = decode(Settlement(group=0, relay_id="r", moves=(move,)).encode())
    assert back.moves == (move,)
    assert back.moves[0].before.window_to is None
    assert back.moves[0].after.last_id is None


def test_an_empty_settlement_reads_back_empty() -> None:
    written = Settlement(group=GROUP_COUNT - 1, relay_id="r")
    back = decode(written.encode())
    assert back == written
    assert back.outbox == ""
    assert (back.moves, back.parked, back.marked) == ((), (), ())


def test_outcomes_are_written_grouped_by_state_reason_and_held_for() -> None:
    body = json.loads(_settlement().encode())
    assert body["format"] == 1
    assert body["group"] == 3
    assert body["relay_id"] == "relay-a:1"
    assert body["outbox"] == "0a1b2c3d-e5f6/16384"
    assert body["moves"][0] == [24, [7, None, None, None], [7, 9, 120, 300]]
    assert body["parked"] == [
        ["failed", "Broker: Message size too large", None, [5, 7]],
        ["failed", "held: Broker: Unknown topic or partition", "orders", [6]],
    ]
    assert body["marked"] == [["published", None, None, [8, 10]], ["failed", "bad headers", None, [9]]]


def test_interleaved_reasons_read_back_as_the_same_rows_grouped_by_reason() -> None:
    parked = (
        RowOutcome(1, FAILED, "a"),
        RowOutcome(2, FAILED, "b"),
        RowOutcome(3, FAILED, "a"),
        RowOutcome(4, FAILED, "b", "orders"),
    )
    back = decode(Settlement(group=0, relay_id="r", parked=parked).encode()).parked
    assert sorted(back) == sorted(parked)
    assert [o.row_id for o in back] == [1, 3, 2, 4]  # one group per (state, reason, held_for)


def test_held_rows_keep_the_topic_they_wait_for() -> None:
    parked = (
        RowOutcome(1, FAILED, "held: unknown topic", "orders"),
        RowOutcome(2, FAILED, "held: unknown topic", "payments"),
        RowOutcome(3, FAILED, "held: unknown topic", None),
    )
    back = decode(Settlement(group=0, relay_id="r", parked=parked).encode()).parked
    assert {(o.row_id, o.held_for) for o in back} == {(1, "orders"), (2, "payments"), (3, None)}
    assert len(json.loads(Settlement(group=0, relay_id="r", parked=parked).encode())["parked"]) == 3


def test_a_long_reason_is_cut_to_reason_chars_and_written_once_for_all_its_rows() -> None:
    long = "é" + "x" * 5000
    parked = tuple(RowOutcome(i, FAILED, long + str(i % 2)) for i in range(1000))  # differ past the cut
    value = Settlement(group=0, relay_id="r", parked=parked).encode()
    body = json.loads(value)
    assert len(body["parked"]) == 1  # cut alike: one reason
    assert body["parked"][0][3] == list(range(1000))
    back = decode(value).parked
    assert {o.error for o in back} == {long[:REASON_CHARS]}
    assert len(long[:REASON_CHARS]) == REASON_CHARS
    assert len(value) < 2 * REASON_CHARS + 10 * 1000  # the reason is not repeated per row


def test_a_reason_at_the_limit_is_kept_whole() -> None:
    reason = "r" * REASON_CHARS
    back = decode(Settlement(group=0, relay_id="r", marked=(RowOutcome(1, FAILED, reason),)).encode())
    assert back.marked == (RowOutcome(1, FAILED, reason),)


def _body(**changes: Any) -> bytes:
    body = json.loads(_settlement().encode())
    for key, value in changes.items():
        if value is _MISSING:
            del body[key]
        else:
            body[key] = value
    return json.dumps(body).encode()


_MISSING = object()


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"{",
        b"null",
        b"[]",
        b"42",
        b'"a settlement"',
        b'{"format": 1}',
    ],
)
def test_a_value_that_is_not_json_or_not_an_object_is_no_settlement(value: bytes | None) -> None:
    with pytest.raises(SettlementError):
        decode(value)


@pytest.mark.parametrize("fmt", [0, 2, "1", None, _MISSING])
def test_another_format_is_no_settlement(fmt: object) -> None:
    with pytest.raises(SettlementError, match="not a settlement of format 1"):
        decode(_body(format=fmt))


@pytest.mark.parametrize("key", ["group", "relay_id", "outbox", "moves", "parked", "marked"])
def test_a_settlement_missing_a_key_is_unreadable(key: str) -> None:
    with pytest.raises(SettlementError, match="not a readable settlement: KeyError"):
        decode(_body(**{key: _MISSING}))


@pytest.mark.parametrize(
    "changes",
    [
        {"group": "three"},
        {"group": None},
        {"group": [3]},
        {"outbox": 16384},
        {"outbox": None},
        {"moves": 5},
        {"moves": None},
        {"moves": [[24, [7, None, None, None]]]},  # no cursor after
        {"moves": [[24, [7, None, None], [7, None, None, None]]]},  # a cursor of three fields
        {"moves": [[24, None, [7, None, None, None]]]},
        {"moves": [["shard", [7, None, None, None], [7, None, None, None]]]},
        {"moves": [[24, ["tick", None, None, None], [7, None, None, None]]]},
        {"moves": [[24, [7, None, None, None], [7, "nine", None, None]]]},
        {"parked": 5},
        {"parked": "abcd"},
        {"parked": [["failed", "reason", None]]},
        {"parked": [["failed", "reason", None, 5]]},
        {"parked": [["failed", "reason", None, ["five"]]]},
        {"parked": [["parked", "reason", None, [5]]]},  # no such row state
        {"marked": {"published": [8]}},
        {"marked": [["published", None, None, [None]]]},
    ],
)
def test_a_settlement_with_a_field_of_the_wrong_type_is_unreadable(changes: dict[str, Any]) -> None:
    with pytest.raises(SettlementError, match="not a readable settlement"):
        decode(_body(**changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"parked": [["failed", 5, None, [5]]]},
        {"parked": [["failed", "reason", ["orders"], [5]]]},
        {"marked": [["failed", {"why": "x"}, None, [9]]]},
    ],
)
def test_a_reason_or_held_for_that_is_not_text_is_unreadable(changes: dict[str, Any]) -> None:
    with pytest.raises(SettlementError):
        decode(_body(**changes))


_cursors = st.builds(
    Cursor,
    st.just(0),
    st.integers(0, 2**62),
    st.none() | st.integers(0, 2**62),
    st.none() | st.integers(0, 2**62),
    st.none() | st.integers(0, 2**62),
)
_outcomes = st.builds(
    RowOutcome,
    st.integers(1, 2**62),
    st.sampled_from(list(RowState)),
    st.none() | st.text(max_size=300),
    st.none() | st.text(min_size=1, max_size=20),  # a held row's topic: never empty
)


@settings(max_examples=200, deadline=None)
@given(
    group=st.integers(0, GROUP_COUNT - 1),
    relay_id=st.text(max_size=48),
    outbox=st.text(max_size=60),
    moves=st.lists(st.tuples(_cursors, _cursors), max_size=8),
    parked=st.lists(_outcomes, max_size=20),
    marked=st.lists(_outcomes, max_size=20),
)
def test_any_settlement_reads_back_with_its_rows_and_reasons_cut(
    group: int,
    relay_id: str,
    outbox: int,
    moves: list[tuple[Cursor, Cursor]],
    parked: list[RowOutcome],
    marked: list[RowOutcome],
) -> None:
    cursor_moves = tuple(CursorMove(0, before, after) for before, after in moves)
    written = Settlement(
        group=group,
        relay_id=relay_id,
        outbox=outbox,
        moves=cursor_moves,
        parked=tuple(parked),
        marked=tuple(marked),
    )
    back = decode(written.encode())
    assert (back.group, back.relay_id, back.outbox, back.moves) == (group, relay_id, outbox, cursor_moves)

    def cut(outcomes: list[RowOutcome]) -> list[tuple[object, ...]]:
        return sorted(
            (o.row_id, o.state.value, o.error is None, (o.error or "")[:REASON_CHARS], o.held_for or "")
            for o in outcomes
        )

    assert cut(list(back.parked)) == cut(parked)
    assert cut(list(back.marked)) == cut(marked)
    assert all(isinstance(o.state, RowState) for o in (*back.parked, *back.marked))


# -- the plan: which rows a batch sends -------------------------------------------------------------------


def test_every_row_sendable_is_sent_and_published() -> None:
    planned = plan([1, 2, 3], ["a", "b", "a"], [0, 1, 0], [None, None, None], read_past=True)
    assert planned.send == [0, 1, 2]
    assert (planned.outcome.published, planned.outcome.failed, planned.outcome.retried) == (3, 0, 0)
    assert states(planned) == [PUBLISHED] * 3
    # Nothing learned or suspected about these rows changes that.
    again = plan([1, 2, 3], ["a", "b", "a"], [0, 1, 0], [None] * 3, False, {99: PARK}, frozenset({98}))
    assert again.send == [0, 1, 2]
    assert again.outcome.published == 3
    assert plan([1, 2], ["a", "b"], [0, 1], [None, None], True, {}, frozenset()).send == [0, 1]


def test_an_empty_page_sends_nothing() -> None:
    planned = plan([], [], [], [], read_past=True)
    assert planned.send == []
    assert (planned.outcome.published, planned.outcome.failed, planned.outcome.retried) == (0, 0, 0)


def test_rows_of_unequal_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="zip"):
        plan([1, 2], ["a", "b"], [0, 1], [None], read_past=True)


def test_a_row_whose_fate_is_known_before_sending_is_not_sent() -> None:
    planned = plan(
        [1, 2, 3, 4, 5, 6],
        ["a", "b", "c", "d", "e", "f"],
        [0, 1, 2, 3, 4, 5],
        [None, PARK, HOLD, RETRY, BLOCKED, None],
        read_past=False,
    )
    assert planned.send == [0, 5]
    assert states(planned) == [PUBLISHED, FAILED, FAILED, PENDING, PENDING, PUBLISHED]
    rows = planned.outcome.rows
    assert rows[1] == RowOutcome(2, FAILED, PARK.reason)
    assert rows[2] == RowOutcome(3, FAILED, HOLD.reason, "orders")
    assert rows[3].error == RETRY.reason
    assert (planned.outcome.published, planned.outcome.failed, planned.outcome.retried) == (2, 2, 2)


def test_a_parked_row_does_not_hold_back_the_later_rows_of_its_aggregate_or_shard() -> None:
    for read_past in (False, True):
        planned = plan([1, 2, 3], ["a", "a", "a"], [4, 4, 4], [None, PARK, None], read_past)
        assert planned.send == [0, 2]
        assert states(planned) == [PUBLISHED, FAILED, PUBLISHED]


def test_a_row_to_retry_holds_back_the_later_rows_of_its_aggregate_not_others() -> None:
    planned = plan([1, 2, 3, 4], ["a", "b", "a", "b"], [0, 1, 0, 1], [RETRY, None, None, None], False)
    assert planned.send == [1, 3]
    assert states(planned) == [PENDING, PUBLISHED, PENDING, PUBLISHED]
    assert errors(planned)[2] == "held back behind an earlier failed event"


def test_on_a_page_read_past_a_row_to_retry_holds_back_the_later_rows_of_its_shard() -> None:
    ids, aggregates, shards = [1, 2, 3, 4, 5], ["z", "a", "b", "a", "c"], [0, 0, 0, 0, 1]
    known = [None, RETRY, None, None, None]
    planned = plan(ids, aggregates, shards, known, read_past=True)
    # Row 1 (before the retry) and row 5 (another shard) go; rows 3 and 4, behind it in its shard, do not.
    assert planned.send == [0, 4]
    assert states(planned) == [PUBLISHED, PENDING, PENDING, PENDING, PUBLISHED]
    assert errors(planned) == [
        None,
        RETRY.reason,
        HELD_IN_SHARD,  # another aggregate: demoted because of its shard
        "held back behind an earlier failed event",  # the same aggregate
        None,
    ]
    assert (planned.outcome.published, planned.outcome.failed, planned.outcome.retried) == (2, 0, 3)


def test_without_read_past_a_row_to_retry_holds_back_only_its_aggregate() -> None:
    ids, aggregates, shards = [1, 2, 3, 4, 5], ["z", "a", "b", "a", "c"], [0, 0, 0, 0, 1]
    planned = plan(ids, aggregates, shards, [None, RETRY, None, None, None], read_past=False)
    assert planned.send == [0, 2, 4]
    assert states(planned) == [PUBLISHED, PENDING, PUBLISHED, PENDING, PUBLISHED]


def test_a_row_held_behind_its_aggregate_also_stops_its_shard_on_a_page_read_past() -> None:
    # Row 3 is pending only because its aggregate's row 1 is: it too stops shard 5 for row 4.
    planned = plan([1, 2, 3, 4], ["a", "x", "a", "y"], [9, 5, 5, 5], [RETRY, None, None, None], True)
    assert planned.send == [1]
    assert states(planned) == [PENDING, PUBLISHED, PENDING, PENDING]
    assert errors(planned)[3] == HELD_IN_SHARD


def test_learned_fates_by_row_id_override_rows_that_were_going_to_be_sent() -> None:
    refused = Delivery(Disposition.PARK, "Broker: Invalid record")
    planned = plan(
        [10, 20, 30, 40],
        ["a", "b", "a", "c"],
        [0, 1, 0, 2],
        [None, None, None, None],
        read_past=True,
        learned={20: refused, 40: RETRY, 2: PARK},  # 2 is an index, not a row id: no effect
    )
    assert planned.send == [0, 2]
    assert states(planned) == [PUBLISHED, FAILED, PUBLISHED, PENDING]
    assert planned.outcome.rows[1] == RowOutcome(20, FAILED, refused.reason)
    assert planned.outcome.rows[3].error == RETRY.reason


def test_a_learned_fate_does_not_override_a_fate_known_before_sending() -> None:
    planned = plan([10, 20], ["a", "b"], [0, 1], [HOLD, None], True, learned={10: PARK, 20: DELIVERED})
    assert planned.outcome.rows[0] == RowOutcome(10, FAILED, HOLD.reason, "orders")
    assert planned.send == [1]


def test_a_learned_retry_holds_back_its_shard_on_a_page_read_past() -> None:
    planned = plan([10, 20, 30], ["a", "b", "c"], [3, 3, 4], [None] * 3, True, learned={10: RETRY})
    assert planned.send == [2]
    assert errors(planned)[1] == HELD_IN_SHARD


def test_a_suspect_first_on_the_page_is_sent_alone() -> None:
    for read_past in (False, True):
        planned = plan(
            [10, 11, 12, 13, 14],
            ["a", "b", "c", "a", "d"],
            [0, 1, 2, 0, 3],
            [None, None, PARK, None, HOLD],
            read_past,
            suspects=frozenset({10, 13}),
        )
        assert planned.send == [0]
        assert states(planned) == [PUBLISHED, PENDING, FAILED, PENDING, FAILED]
        # Every other row that would have been sent waits; rows known before sending keep their fate.
        assert errors(planned) == [None, TRIED_ALONE, PARK.reason, TRIED_ALONE, HOLD.reason]


def test_a_suspect_first_on_the_page_is_sent_alone_even_when_another_row_was_learned() -> None:
    planned = plan(
        [10, 11, 12],
        ["a", "b", "c"],
        [0, 1, 2],
        [None, None, None],
        True,
        learned={12: PARK},
        suspects=frozenset({10}),
    )
    assert planned.send == [0]
    assert states(planned) == [PUBLISHED, PENDING, PENDING]


def test_the_page_is_sent_up_to_its_first_suspect_and_not_from_it_on() -> None:
    for read_past in (False, True):
        planned = plan(
            [10, 11, 12, 13, 14, 15],
            ["a", "b", "c", "d", "e", "f"],
            [0, 1, 2, 3, 4, 5],
            [None, PARK, None, None, RETRY, None],
            read_past,
            suspects=frozenset({11, 13, 15}),  # 11's fate is known: it is not tried; 13 is the first
        )
        assert planned.send == [0, 2]
        assert states(planned) == [PUBLISHED, FAILED, PUBLISHED, PENDING, PENDING, PENDING]
        assert errors(planned) == [None, PARK.reason, None, TRIED_ALONE, RETRY.reason, TRIED_ALONE]


def test_a_suspect_whose_fate_is_known_is_not_tried_alone() -> None:
    planned = plan([10, 11, 12], ["a", "b", "c"], [0, 1, 2], [PARK, None, None], True, suspects={10})
    assert planned.send == [1, 2]
    assert states(planned) == [FAILED, PUBLISHED, PUBLISHED]


def test_a_suspect_behind_a_row_known_before_sending_waits_for_a_page_it_begins() -> None:
    planned = plan([10, 11, 12], ["a", "b", "c"], [0, 1, 2], [PARK, None, None], True, suspects={11})
    assert planned.send == []
    assert states(planned) == [FAILED, PENDING, PENDING]


_known = st.sampled_from([None, None, None, PARK, RETRY, HOLD, BLOCKED])
_learnt = st.sampled_from([PARK, RETRY, DELIVERED, Delivery(Disposition.PARK, "refused alone")])


@st.composite
def _pages(draw: st.DrawFn) -> tuple[Any, ...]:
    n = draw(st.integers(0, 12))
    ids = sorted(draw(st.sets(st.integers(1, 1000), min_size=n, max_size=n)))
    aggregates = draw(st.lists(st.sampled_from("abcdef"), min_size=n, max_size=n))
    shard_of = {a: draw(st.integers(0, 3)) for a in "abcdef"}  # a shard is a function of the aggregate
    shards = [shard_of[a] for a in aggregates]
    known = draw(st.lists(_known, min_size=n, max_size=n))
    learned = draw(st.none() | st.dictionaries(st.sampled_from(ids) if ids else st.nothing(), _learnt))
    suspects = draw(st.frozensets(st.sampled_from(ids) if ids else st.nothing()))
    read_past = draw(st.booleans())
    return ids, aggregates, shards, known, read_past, learned, suspects


@settings(max_examples=1000, deadline=None)
@given(page=_pages())
def test_a_row_is_sent_exactly_when_the_plan_marks_it_published(page: tuple[Any, ...]) -> None:
    ids, aggregates, shards, known, read_past, learned, suspects = page
    planned = plan(ids, aggregates, shards, known, read_past, learned, suspects)
    rows = planned.outcome.rows
    assert [r.row_id for r in rows] == ids
    assert planned.send == [i for i, r in enumerate(rows) if r.state is PUBLISHED]
    outcome = planned.outcome
    assert (outcome.published, outcome.failed, outcome.retried) == (
        sum(r.state is PUBLISHED for r in rows),
        sum(r.state is FAILED for r in rows),
        sum(r.state is PENDING for r in rows),
    )
    # Only rows to be sent are sent: never one whose fate was known before sending.
    assert all(known[i] is None for i in planned.send)
    for i, fate in enumerate(known):
        if fate is not None and fate.disposition in (Disposition.PARK, Disposition.HOLD):
            assert rows[i].state is FAILED
        elif fate is not None:
            assert rows[i].state is PENDING
    # Never a row sent behind a row to retry of its aggregate, nor, on a page read past, of its shard.
    for i in planned.send:
        before = range(i)
        assert not any(rows[j].state is PENDING and aggregates[j] == aggregates[i] for j in before)
        if read_past:
            assert not any(rows[j].state is PENDING and shards[j] == shards[i] for j in before)
    # A suspect is tried alone: when the first untried suspect begins the page it goes alone, otherwise
    # the page goes up to it.
    first = next((i for i, r in enumerate(ids) if r in suspects and known[i] is None), None)
    if first == 0:
        assert set(planned.send) <= {0}
    elif first is not None:
        assert all(i < first for i in planned.send)
    # With nothing known, learned or suspected, everything goes.
    if all(k is None for k in known) and not learned and not suspects:
        assert planned.send == list(range(len(ids)))
        assert outcome.published == len(ids)


# -- the relay's --exactly-once settings ------------------------------------------------------------------


def test_exactly_once_is_off_by_default() -> None:
    assert relay_settings().exactly_once is False
    assert relay_settings().transactional_id_prefix is None


@pytest.mark.parametrize("mode", ["log", "auto"])
def test_exactly_once_runs_in_log_or_auto_mode(mode: str) -> None:
    assert relay_settings(exactly_once=True, mode=mode).exactly_once is True


def test_exactly_once_in_queue_mode_is_refused_naming_log_mode() -> None:
    with pytest.raises(SettingsError, match=r"^--exactly-once \(POSTBOX_RELAY_EXACTLY_ONCE\) needs log mode"):
        relay_settings(exactly_once=True, mode="queue")
    assert relay_settings(exactly_once=False, mode="queue").mode == "queue"


@pytest.mark.parametrize("exactly_once", [False, True])
def test_a_transactional_id_passed_through_is_refused(exactly_once: bool) -> None:
    with pytest.raises(SettingsError, match=r"^kafka-config transactional.id: .*--transactional-id-prefix"):
        relay_settings(exactly_once=exactly_once, kafka_config={"transactional.id": "mine"})


@pytest.mark.parametrize("prefix", ["has space", "a/b", "a:b", "é", "x" * 201, "pre\nfix"])
def test_an_invalid_transactional_id_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(SettingsError, match=r"^--transactional-id-prefix \(POSTBOX_RELAY_TRANSACTIONAL_ID"):
        relay_settings(exactly_once=True, transactional_id_prefix=prefix)


@pytest.mark.parametrize("prefix", ["shop", "acme.shop-outbox_2", "x" * 200, "-"])
def test_a_valid_transactional_id_prefix_names_the_cursor_topic(prefix: str) -> None:
    given = relay_settings(exactly_once=True, transactional_id_prefix=prefix)
    assert given.transactional_prefix("0a1b2c3d-aaaa") == prefix


def test_a_schema_the_default_prefix_cannot_carry_asks_for_a_prefix() -> None:
    with pytest.raises(SettingsError, match="--transactional-id-prefix"):
        relay_settings(exactly_once=True, schema="my schema")
    mine = relay_settings(exactly_once=True, schema="my schema", transactional_id_prefix="mine")
    assert mine.transactional_prefix("0a1b2c3d-aaaa") == "mine"


def test_the_default_prefix_names_the_schema_and_the_outbox() -> None:
    """Two outboxes on one Kafka cluster, even with the same schema name, never share transactional ids or
    a cursor topic: the default prefix carries the outbox's own id (its first 8 characters)."""
    default = relay_settings(exactly_once=True)
    assert default.transactional_prefix("0a1b2c3d-e5f6/16384") == f"postbox.{default.schema}.0a1b2c3d"
    shop = relay_settings(exactly_once=True, schema="shop")
    assert shop.transactional_prefix("ffffffff-0000/1") == "postbox.shop.ffffffff"


@pytest.mark.parametrize("timeout", ["19999", "0", "-1", "abc", "", "20000.5"])
def test_a_transaction_timeout_below_the_delivery_timeout_is_refused(timeout: str) -> None:
    with pytest.raises(SettingsError, match=rf"^kafka-config transaction.timeout.ms={timeout}: .*20000 ms"):
        relay_settings(
            exactly_once=True, delivery_timeout=20, kafka_config={"transaction.timeout.ms": timeout}
        )


@pytest.mark.parametrize("timeout", ["20000", "60000"])
def test_a_transaction_timeout_covering_the_delivery_timeout_is_kept(timeout: str) -> None:
    given = relay_settings(exactly_once=True, kafka_config={"transaction.timeout.ms": timeout})
    assert given.transactional_config()["transaction.timeout.ms"] == timeout


def test_the_default_transaction_timeout_is_the_delivery_timeout_and_ten_seconds() -> None:
    assert relay_settings(exactly_once=True).transactional_config()["transaction.timeout.ms"] == 30_000
    config = relay_settings(exactly_once=True, delivery_timeout=5.5).transactional_config()
    assert config["transaction.timeout.ms"] == 15_500
    assert config["message.timeout.ms"] == 5_500


def test_the_transactional_config_is_the_producer_config_without_a_transactional_id() -> None:
    given = relay_settings(exactly_once=True, kafka_config={"linger.ms": "20"})
    config = given.transactional_config()
    assert "transactional.id" not in config
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"
    assert config["linger.ms"] == "20"
    added = {"transaction.timeout.ms", "retry.backoff.ms", "retry.backoff.max.ms"}
    assert {k: v for k, v in config.items() if k not in added} == given.producer_config()
    assert added.isdisjoint(given.producer_config())
    # Back-to-back transactions wait out CONCURRENT_TRANSACTIONS in retry.backoff: short, unless given.
    assert (config["retry.backoff.ms"], config["retry.backoff.max.ms"]) == (5, 50)
    mine = relay_settings(exactly_once=True, kafka_config={"retry.backoff.ms": "200"}).transactional_config()
    assert mine["retry.backoff.ms"] == "200"
    assert "retry.backoff.max.ms" not in mine, "librdkafka's own, never below a backoff given"
