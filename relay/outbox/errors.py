"""What a Kafka error means for a row. Pure: maps librdkafka error codes to what the relay does next."""

from __future__ import annotations

import enum

from confluent_kafka import KafkaError


class Disposition(enum.Enum):
    RETRY = "retry"  # transient (broker down, timeout): leave pending, back off, try again
    PARK = "park"  # this row can never be published as it is: mark failed with the reason
    TOPIC_BLOCKED = "topic"  # the topic is unusable (unknown, not authorised): hold its rows, go unready
    # Log mode's answer to a blocked topic: the row is parked as held (with the topic it waits for), and so
    # is every later row of its aggregate, so that the rest of its shard flows; all are put back in the
    # queue, in id order, once the topic can take messages.
    HOLD = "hold"
    FATAL = "fatal"  # the producer itself is broken: stop the process non-zero


_PARK = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_TIMESTAMP,
    KafkaError._INVALID_ARG,
    KafkaError._KEY_SERIALIZATION,
    KafkaError._VALUE_SERIALIZATION,
}

_TOPIC = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.POLICY_VIOLATION,
}

_FATAL = {
    KafkaError._FATAL,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._AUTHENTICATION,
    KafkaError._SSL,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.PRODUCER_FENCED,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
}


def classify(code: int, fatal: bool = False) -> Disposition:
    if fatal or code in _FATAL:
        return Disposition.FATAL
    if code in _PARK:
        return Disposition.PARK
    if code in _TOPIC:
        return Disposition.TOPIC_BLOCKED
    return Disposition.RETRY
