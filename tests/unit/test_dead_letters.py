"""The dead-letter topic's sending (inbox.dead_letters) against a stand-in producer: what each dead letter
carries, and that a batch's send fails (so the batch is rolled back and read again) unless every one of
them was delivered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from postbox.inbox.dead_letters import DeadLetters
from postbox.inbox.message import Message

Delivery = Callable[[KafkaError | None, object], None]


class FakeProducer:
    """Records what is produced; delivers each with `error` on flush, and leaves `remaining` unsent."""

    def __init__(self, error: KafkaError | None = None, remaining: int = 0) -> None:
        self.produced: list[dict[str, Any]] = []
        self.flushes: list[float] = []
        self.polls = 0
        self._error = error
        self._remaining = remaining
        self._pending: list[Delivery] = []

    def produce(self, topic: str, value: Any, key: Any, *, headers: Any, on_delivery: Delivery) -> None:
        self.produced.append({"topic": topic, "value": value, "key": key, "headers": headers})
        self._pending.append(on_delivery)

    def flush(self, timeout: float) -> int:
        self.flushes.append(timeout)
        for on_delivery in self._pending:
            on_delivery(self._error, None)
        self._pending = []
        return self._remaining

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0


def parked(offset: int, headers: dict[str, bytes] | None = None) -> Message:
    return Message("orders", 3, offset, b"k-1", b'{"a": 1}', headers or {}, f"id-{offset}", "X")


def test_every_parked_message_goes_with_its_headers_the_reason_and_where_it_was_read() -> None:
    producer = FakeProducer()
    DeadLetters(producer, "orders.dlq").send(  # type: ignore[arg-type]
        [(parked(7, {"id": b"id-7", "eventType": b"X"}), "ValueError: bad"), (parked(8), "Unhandled: X")]
    )
    assert producer.produced == [
        {
            "topic": "orders.dlq",
            "value": b'{"a": 1}',
            "key": b"k-1",
            "headers": [
                ("id", b"id-7"),
                ("eventType", b"X"),
                ("postbox.error", b"ValueError: bad"),
                ("postbox.source", b"orders/3/7"),
            ],
        },
        {
            "topic": "orders.dlq",
            "value": b'{"a": 1}',
            "key": b"k-1",
            "headers": [("postbox.error", b"Unhandled: X"), ("postbox.source", b"orders/3/8")],
        },
    ]
    assert producer.flushes == [30.0]  # one wait for the whole batch


def test_a_delivery_error_fails_the_send_with_the_brokers_reason() -> None:
    producer = FakeProducer(error=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    too_large = r"dead-letter produce failed: \['Broker: Message size too large'\]"
    with pytest.raises(KafkaException, match=too_large):
        DeadLetters(producer, "dlq").send([(parked(1), "boom")])  # type: ignore[arg-type]


def test_a_dead_letter_still_unsent_after_the_wait_fails_the_send() -> None:
    producer = FakeProducer(remaining=1)
    with pytest.raises(KafkaException, match=r"dead-letter produce failed: \[\]") as failed:
        DeadLetters(producer, "dlq").send([(parked(1), "boom")])  # type: ignore[arg-type]
    assert failed.value.args[0].code() == KafkaError._MSG_TIMED_OUT


def test_serving_polls_and_closing_flushes_briefly() -> None:
    producer = FakeProducer()
    dead_letters = DeadLetters(producer, "dlq")  # type: ignore[arg-type]
    dead_letters.serve()
    dead_letters.close()
    assert (producer.polls, producer.flushes) == (1, [10.0])
