"""relay.outbox.lane_turns: a lane that found nothing waits for another's batch, and the drain ends only
when every lane is idle having seen every batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from postbox.relay.outbox.lane_turns import LaneTurns


def test_a_lone_lane_that_finds_nothing_ends_the_drain_at_once() -> None:
    turns = LaneTurns(1)
    assert turns.look_again(0, turns.finished) is False


def test_a_batch_finished_during_the_claim_means_looking_again_at_once() -> None:
    turns = LaneTurns(2)
    seen = turns.finished
    turns.batch_finished()  # the other lane marked a batch while this one claimed
    assert turns.look_again(0, seen) is True


def test_an_idle_lane_waits_for_the_other_lanes_batch_then_claims_again() -> None:
    turns = LaneTurns(2)
    with ThreadPoolExecutor(1) as pool:
        idle = pool.submit(turns.look_again, 0, turns.finished)
        with pytest.raises(TimeoutError):
            idle.result(timeout=0.2)  # the other lane is still working: no verdict yet
        turns.batch_finished()
        assert idle.result(timeout=5) is True


def test_the_drain_is_over_when_every_lane_is_idle_having_seen_every_batch() -> None:
    turns = LaneTurns(2)
    turns.batch_finished()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(turns.look_again, 0, turns.finished)
        with pytest.raises(TimeoutError):
            first.result(timeout=0.2)
        assert turns.look_again(1, turns.finished) is False
        assert first.result(timeout=5) is False


def test_a_lane_that_leaves_releases_the_waiting_ones() -> None:
    turns = LaneTurns(3)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(turns.look_again, lane, turns.finished) for lane in (0, 1)]
        with pytest.raises(TimeoutError):
            waiting[0].result(timeout=0.2)
        turns.leave()  # lane 2 stops (leases due, a stop, an error)
        assert [w.result(timeout=5) for w in waiting] == [False, False]
