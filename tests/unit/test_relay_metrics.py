"""The relay's metric labels: bounded, whatever topics writers route to."""

from __future__ import annotations

from postbox.relay.outbox.metrics import OTHER_TOPICS, TopicLabels


def test_topic_labels_stop_at_their_limit_and_keep_the_ones_they_gave() -> None:
    label = TopicLabels(limit=2)
    assert [label("a"), label("b"), label("c"), label("a")] == ["a", "b", OTHER_TOPICS, "a"]
