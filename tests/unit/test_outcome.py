from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import DELIVERED, Delivery, decide

OK = Delivery(None)


def test_all_delivered_are_published() -> None:
    outcome = decide([1, 2], ["a", "b"], [OK, OK])
    assert [(r.row_id, r.state) for r in outcome.rows] == [(1, "published"), (2, "published")]
    assert (outcome.published, outcome.failed, outcome.retried) == (2, 0, 0)


def test_a_permanent_failure_parks_only_that_row() -> None:
    too_big = Delivery(Disposition.PARK, "Broker: Message size too large")
    outcome = decide([1, 2, 3], ["a", "a", "b"], [OK, too_big, OK])
    assert [(r.state, r.error) for r in outcome.rows] == [
        ("published", None),
        ("failed", "Broker: Message size too large"),
        ("published", None),
    ]


def test_after_a_retry_the_same_aggregate_is_held_back_but_others_flow() -> None:
    timeout = Delivery(Disposition.RETRY, "Local: Message timed out")
    outcome = decide([1, 2, 3, 4], ["a", "b", "a", "b"], [timeout, OK, OK, OK])
    assert [r.state for r in outcome.rows] == ["pending", "published", "pending", "published"]
    assert outcome.rows[2].error == "held back behind an earlier failed event"
    assert outcome.retried == 2


def test_rows_of_a_blocked_topic_or_a_fatal_error_stay_pending_with_the_reason() -> None:
    # The daemon blocks the topic and stops on the producer's fatal flag; the rows wait for either.
    blocked = Delivery(Disposition.TOPIC_BLOCKED, "unknown topic")
    fatal = Delivery(Disposition.FATAL, "fenced")
    outcome = decide([1, 2], ["a", "b"], [blocked, fatal])
    assert [(r.state, r.error) for r in outcome.rows] == [("pending", "unknown topic"), ("pending", "fenced")]
    assert outcome.retried == 2


def test_a_batch_of_shared_delivered_reports_reads_as_the_one_by_one_decision() -> None:
    # decide takes a shortcut when every report is the shared DELIVERED; it must read the same.
    shortcut = decide([5, 6, 7], ["a", "a", "b"], [DELIVERED] * 3)
    one_by_one = decide([5, 6, 7], ["a", "a", "b"], [OK] * 3)
    assert shortcut.decided is None
    assert one_by_one.decided is not None
    assert shortcut.rows == one_by_one.rows
    assert (shortcut.published, shortcut.failed, shortcut.retried) == (3, 0, 0)
