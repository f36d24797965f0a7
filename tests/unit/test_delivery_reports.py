"""Which message a delivery report is about (relay.outbox.publisher.KafkaSending), without a broker: the
reports are fed in as librdkafka hands them to the callbacks while the producer is polled. That Kafka
delivers and acknowledges is for the integration tests; this is the bookkeeping that turns reports back
into one outcome per row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import DELIVERED, Delivery
from postbox.relay.outbox.publisher import KafkaSending
from postbox.relay.outbox.routing import Message

Report = Callable[[KafkaError | None, Any], None]


class Landed:
    """What librdkafka passes with a report: the message as produced (headers, partition, offset)."""

    def __init__(self, message: Message, offset: int) -> None:
        self._headers = message.headers
        self._offset = offset

    def headers(self) -> list[tuple[str, Any]]:
        return list(self._headers)

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class Reports:
    """A producer's poll(): serves the reports queued so far, in the order given."""

    def __init__(self) -> None:
        self.queued: list[tuple[Report, KafkaError | None, Landed]] = []
        self.polls = 0

    def poll(self, _timeout: float) -> int:
        self.polls += 1
        served, self.queued = self.queued, []
        for report, error, landed in served:
            report(error, landed)
        return len(served)


def messages(*event_ids: str) -> list[Message]:
    return [Message("t", b"k", b"{}", [("id", e.encode()), ("other", b"x")]) for e in event_ids]


def sending(
    batch: list[Message], reports: Reports, timeout: float = 30.0, traced: bool = False
) -> tuple[KafkaSending, list[int]]:
    delivered: list[int] = []
    sent = KafkaSending(reports, batch, timeout, lambda: delivered.append(1), record_acks=traced)  # type: ignore[arg-type]
    sent.produced = len(batch)
    return sent, delivered


def test_every_message_delivered_and_the_cluster_noted_reachable_once() -> None:
    reports, batch = Reports(), messages("a", "b", "c")
    sent, delivered = sending(batch, reports)
    reports.queued = [(sent.on_delivery, None, Landed(m, i)) for i, m in enumerate(batch)]
    assert sent.wait(lambda: None) == [DELIVERED] * 3
    assert delivered == [1]


def test_a_failed_message_is_matched_to_its_row_by_event_id() -> None:
    reports, batch = Reports(), messages("a", "b", "c")
    sent, _ = sending(batch, reports)
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    errors = [None, too_large, None]
    # Reports come in any order across partitions.
    reports.queued = [(sent.on_delivery, errors[i], Landed(batch[i], i)) for i in (2, 1, 0)]
    outcome = sent.wait(lambda: None)
    assert outcome[0] == DELIVERED
    assert outcome[2] == DELIVERED
    assert outcome[1].disposition is Disposition.PARK
    assert outcome[1].reason == too_large.str()


def test_a_failure_counts_for_every_copy_of_the_same_event_in_the_batch() -> None:
    reports, batch = Reports(), messages("a", "dup", "dup")
    sent, _ = sending(batch, reports)
    errors = [None, None, KafkaError(KafkaError._MSG_TIMED_OUT)]
    reports.queued = [(sent.on_delivery, errors[i], Landed(m, i)) for i, m in enumerate(batch)]
    outcome = sent.wait(lambda: None)
    assert outcome[0] == DELIVERED
    assert [o.disposition for o in outcome[1:]] == [Disposition.RETRY, Disposition.RETRY]


def test_a_failure_that_names_no_event_takes_nothing_as_delivered() -> None:
    reports, batch = Reports(), messages("a", "b")
    sent, delivered = sending(batch, reports)
    anonymous = Message("t", b"k", b"{}", [])
    reports.queued = [
        (sent.on_delivery, None, Landed(batch[0], 0)),
        (sent.on_delivery, KafkaError(KafkaError._MSG_TIMED_OUT), Landed(anonymous, 1)),
    ]
    outcome = sent.wait(lambda: None)
    assert [o.disposition for o in outcome] == [Disposition.RETRY, Disposition.RETRY]
    assert delivered == []


def test_overdue_reports_leave_every_message_not_known_failed_to_be_tried_again() -> None:
    reports, batch = Reports(), messages("a", "b", "c")
    sent, _ = sending(batch, reports, timeout=-10.0)  # the deadline has passed before the first poll
    outcome = sent.wait(lambda: None)
    assert [o.disposition for o in outcome] == [Disposition.RETRY] * 3
    assert all(o.reason == "no delivery report in time" for o in outcome)


def test_a_message_refused_at_produce_keeps_its_own_outcome() -> None:
    reports, batch = Reports(), messages("a", "b")
    sent, _ = sending(batch, reports)
    sent.results[1] = refused = Delivery(Disposition.PARK, "refused by the producer")
    sent.produced = 1
    reports.queued = [(sent.on_delivery, None, Landed(batch[0], 0))]
    assert sent.wait(lambda: None) == [DELIVERED, refused]


def test_traced_reports_record_where_each_message_landed() -> None:
    reports, batch = Reports(), messages("a", "b")
    sent, _ = sending(batch, reports, traced=True)
    reports.queued = [
        (sent.reporter(1), None, Landed(batch[1], 7)),
        (sent.reporter(0), KafkaError(KafkaError._MSG_TIMED_OUT), Landed(batch[0], 0)),
    ]
    outcome = sent.wait(lambda: None)
    assert outcome[1] == DELIVERED
    assert outcome[0].disposition is Disposition.RETRY
    acks = sent.acks()
    assert acks[0] is None
    assert acks[1] is not None
    assert acks[1].offset == 7
