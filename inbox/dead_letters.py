"""The dead-letter topic: parked messages sent on, as they were read, with why they were parked.

The Applier (inbox.applying) sends a batch's parked messages here before its commit, so a send that fails
rolls the batch back and it is read again: a parked message is never committed without its dead letter.
Each goes with its key, value and headers, plus `postbox.error` (the reason it was parked) and
`postbox.source` (its topic/partition/offset). The consumer (inbox.consumer) makes one for an Inbox that
names a dead-letter topic, serves its log lines while idle and flushes it at the stop.
"""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import KafkaError, KafkaException, Producer

from postbox.inbox.message import Message
from postbox.relay.core.kafka_config import with_structlog_logger

SEND_SECONDS = 30.0  # for a batch's dead letters to be acknowledged before the batch is rolled back
CLOSE_SECONDS = 10.0  # for what is still queued at the stop


def dead_letter_headers(message: Message, reason: str) -> list[tuple[str, str | bytes | None]]:
    """The message's own headers, then why it was parked and where it was read."""
    return [
        *message.headers.items(),
        ("postbox.error", reason.encode()),
        ("postbox.source", message.coordinates.encode()),
    ]


class DeadLetters:
    """Sends parked messages to one topic with one producer (idempotent, acks=all when made by
    `producing_to`)."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer = producer
        self.topic = topic

    @classmethod
    def producing_to(cls, topic: str, bootstrap: str, kafka_config: Mapping[str, str]) -> DeadLetters:
        """A producer of its own on the consumer's brokers, with its Kafka settings."""
        producer = Producer(
            with_structlog_logger(
                {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", **kafka_config}
            )
        )
        return cls(producer, topic)

    def send(self, failed: list[tuple[Message, str]]) -> None:
        """Produce every (message, reason) and wait for them all; KafkaException if any is not delivered."""
        errors: list[str] = []

        def on_delivery(error: KafkaError | None, _record: object) -> None:
            if error is not None:
                errors.append(error.str())

        for message, reason in failed:
            self.producer.produce(
                self.topic,
                message.value,
                message.key,
                headers=dead_letter_headers(message, reason),
                on_delivery=on_delivery,
            )
        remaining = self.producer.flush(SEND_SECONDS)
        if remaining or errors:
            raise KafkaException(
                KafkaError(KafkaError._MSG_TIMED_OUT, f"dead-letter produce failed: {errors}")
            )

    def serve(self) -> None:
        """Serve the producer's callbacks (its log lines, kafka_client_log) while nothing is sent: librdkafka
        delivers them only on poll."""
        self.producer.poll(0)

    def close(self) -> None:
        """Wait a little for what is still queued (nothing is, after a completed send)."""
        self.producer.flush(CLOSE_SECONDS)
