"""Log mode's held aggregates (relay.outbox.held) and what the mark step makes of a held row."""

from __future__ import annotations

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.held import HeldAggregates
from postbox.relay.outbox.outcome import DELIVERED, Delivery, RowState, decide


def test_an_aggregate_is_held_per_shard_for_the_first_topic_it_met() -> None:
    held = HeldAggregates()
    assert held.waits_for(3, "a") is None
    held.hold(3, "a", "t1")
    held.hold(3, "a", "t2")  # already held: it waits for the first topic
    assert held.waits_for(3, "a") == "t1"
    assert held.waits_for(4, "a") is None, "the same id in another shard is another aggregate"
    assert held.topics() == {"t1"}


def test_releasing_a_topic_frees_only_its_aggregates_and_a_load_replaces_everything() -> None:
    held = HeldAggregates()
    held.hold(1, "a", "t1")
    held.hold(1, "b", "t2")
    held.release("t1")
    assert (held.waits_for(1, "a"), held.waits_for(1, "b")) == (None, "t2")
    held.load([(2, "c", "t3")])
    assert (held.waits_for(1, "b"), held.waits_for(2, "c"), len(held)) == (None, "t3", 1)


def test_a_held_row_is_parked_with_its_topic_and_the_rest_of_the_batch_is_published() -> None:
    hold = Delivery(Disposition.HOLD, "held: topic t: unknown", "t")
    outcome = decide([1, 2, 3], ["a", "a", "b"], [hold, hold, DELIVERED])
    assert [(o.state, o.held_for) for o in outcome.rows] == [
        (RowState.FAILED, "t"),
        (RowState.FAILED, "t"),
        (RowState.PUBLISHED, None),
    ]
    assert (outcome.published, outcome.failed, outcome.retried) == (1, 2, 0)
