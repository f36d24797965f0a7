"""The relay's only door to Kafka: produce a batch, later wait for every delivery report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import tenacity
from confluent_kafka import KafkaError, KafkaException, Producer

from relay.outbox.errors import Disposition, classify
from relay.outbox.outcome import DELIVERED, Delivery
from relay.outbox.routing import Message


class Publisher(Protocol):
    def check_topic(
        self, topic: str, while_waiting: Callable[[], None], patient: bool = True
    ) -> Delivery | None:
        """None when the topic can take messages now, else why not.

        patient: wait (bounded, calling `while_waiting`) for a topic that is being created; otherwise one
        look at the metadata decides.
        """
        ...

    def send(self, messages: Sequence[Message], *, record_acks: bool = False) -> Sending:
        """Hand every message to the producer and return at once; `wait` on the result for the reports
        (and, with record_acks, `acks` for where and when each landed).

        Several sends may be outstanding: the relay produces its next batch while this one's acks are due.
        """
        ...

    @property
    def fatal_error(self) -> str | None:
        """Set once the producer hit a fatal error (it can publish nothing more)."""
        ...

    def broker_trouble(self) -> tuple[float, str] | None:
        """(since when, by time.monotonic(), and why) no broker has been usable (unreachable, or refusing
        our credentials); None while the cluster answers. Checks again, briefly, while in trouble."""
        ...

    def close(self, timeout: float) -> None: ...


class Sending(Protocol):
    def wait(self, while_waiting: Callable[[], None]) -> list[Delivery]:
        """One Delivery per message, in order. `while_waiting` is called regularly while reports are due."""
        ...

    def acks(self) -> list[Ack | None]:
        """Where and when each delivered message landed, in order (None where it was not delivered, or
        when the send did not record acks); for the publish spans, after `wait`."""
        ...


class Ack(NamedTuple):
    partition: int
    offset: int
    at_ns: int  # wall clock (time.time_ns()) of the delivery report


# librdkafka errors (reported through error_cb) that mean "we cannot talk to the cluster": every broker
# down, or our credentials or TLS refused. Each broker reconnection failure alone (_TRANSPORT) is not it.
_UNREACHABLE = {
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._AUTHENTICATION,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._SSL,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
}


class KafkaSending:
    """The delivery reports of one batch, filled in by librdkafka's callbacks as the producer is polled."""

    def __init__(
        self, producer: Producer, size: int, delivery_timeout: float, record_acks: bool = False
    ) -> None:
        self._producer = producer
        self._delivery_timeout = delivery_timeout
        self.results: list[Delivery | None] = [None] * size
        # Only when tracing asks: untraced, the per-message delivery callback stays as cheap as it was.
        self._acks: list[Ack | None] | None = [None] * size if record_acks else None
        self.pending = 0

    def reporter(
        self, index: int, on_delivered: Callable[[], None]
    ) -> Callable[[KafkaError | None, Any], None]:
        def on_delivery(error: KafkaError | None, message: Any) -> None:
            self.pending -= 1
            if error is None:
                self.results[index] = DELIVERED
                if self._acks is not None:
                    self._acks[index] = Ack(message.partition(), message.offset(), time.time_ns())
                on_delivered()
            else:
                self.results[index] = Delivery(classify(error.code(), error.fatal()), error.str())

        return on_delivery

    def wait(self, while_waiting: Callable[[], None]) -> list[Delivery]:
        # librdkafka reports every message within message.timeout.ms; the margin covers the last poll.
        deadline = time.monotonic() + self._delivery_timeout + 10
        next_tick = time.monotonic() + 1
        while self.pending > 0 and time.monotonic() < deadline:
            self._producer.poll(0.05)  # serves every outstanding batch's reports, not only ours
            if time.monotonic() >= next_tick:
                while_waiting()
                next_tick = time.monotonic() + 1
        lost_report = Delivery(Disposition.RETRY, "no delivery report in time")
        return [r or lost_report for r in self.results]

    def acks(self) -> list[Ack | None]:
        return self._acks if self._acks is not None else [None] * len(self.results)


class KafkaPublisher:
    def __init__(
        self,
        config: dict[str, str | int | float | bool],
        topic_wait: float = 10.0,
        on_statistics: Callable[[str], None] | None = None,
    ) -> None:
        self._fatal: str | None = None
        self._trouble: tuple[float, str] | None = None
        self._next_probe = 0.0
        self._topic_wait = topic_wait
        self._delivery_timeout = float(config.get("message.timeout.ms", 300_000)) / 1000
        callbacks: dict[str, Any] = {"error_cb": self._on_error}
        if on_statistics is not None:
            callbacks["stats_cb"] = on_statistics
        self._producer = Producer({**config, **callbacks})

    def _on_error(self, error: KafkaError) -> None:
        # Transient broker errors arrive here too (librdkafka retries them itself); fatal ones end the
        # producer, and "no broker usable" ones make the relay unready after a grace period.
        if error.fatal():
            self._fatal = f"fatal producer error: {error.str()}"
        elif error.code() in _UNREACHABLE and self._trouble is None:
            self._trouble = (time.monotonic(), error.str())

    def _delivered(self) -> None:
        self._trouble = None  # an acknowledged message proves the cluster reachable and us admitted

    def broker_trouble(self) -> tuple[float, str] | None:
        if self._trouble is not None and time.monotonic() >= self._next_probe:
            # librdkafka reports a broker coming back by nothing: ask the cluster (at most every 2 s).
            self._next_probe = time.monotonic() + 2.0
            try:
                self._producer.list_topics(timeout=1.0)
                self._trouble = None
            except KafkaException:
                pass
        self._producer.poll(0)  # serve error_cb even while idle
        return self._trouble

    @property
    def fatal_error(self) -> str | None:
        return self._fatal

    def check_topic(
        self, topic: str, while_waiting: Callable[[], None], patient: bool = True
    ) -> Delivery | None:
        # An unknown topic shows up on produce only as a timeout, and producing into a topic that is still
        # being auto-created fails some messages and not others. So ask the cluster first, and wait
        # (bounded) until every partition has a leader. The first metadata answer for a topic that
        # auto-creation is about to make is "unknown", the same as when auto-creation is off; only an
        # answer still "unknown" after the wait means the topic is missing.
        asking = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda answer: _undecided(answer[0])),
            stop=tenacity.stop_after_delay(self._topic_wait if patient else 0),
            wait=tenacity.wait_fixed(0.2),
            before_sleep=lambda _state: while_waiting(),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        verdict, unknown = asking(self._topic_verdict, topic)
        if verdict is not None and _undecided(verdict) and unknown:
            waited = f" after {self._topic_wait:.0f}s" if patient else ""
            return Delivery(Disposition.TOPIC_BLOCKED, f"{verdict.reason}{waited} (is auto-creation off?)")
        return verdict

    def _topic_verdict(self, topic: str) -> tuple[Delivery | None, bool]:
        """(verdict, whether the cluster says the topic does not exist)."""
        try:
            metadata = self._producer.list_topics(topic, timeout=5)
        except KafkaException as exc:
            error = exc.args[0]
            return Delivery(
                classify(error.code(), error.fatal()), f"metadata for {topic}: {error.str()}"
            ), False
        found = metadata.topics.get(topic)
        if found is None:
            return Delivery(Disposition.RETRY, f"topic {topic}: not in the cluster's metadata"), True
        if found.error is not None:
            code = found.error.code()
            if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.LEADER_NOT_AVAILABLE):
                unknown = code == KafkaError.UNKNOWN_TOPIC_OR_PART
                return Delivery(Disposition.RETRY, f"topic {topic}: {found.error.str()}"), unknown
            return Delivery(classify(code, found.error.fatal()), f"topic {topic}: {found.error.str()}"), False
        if not found.partitions or any(p.leader < 0 for p in found.partitions.values()):
            return Delivery(Disposition.RETRY, f"topic {topic}: a partition has no leader"), False
        return None, False

    def send(self, messages: Sequence[Message], *, record_acks: bool = False) -> KafkaSending:
        sending = KafkaSending(self._producer, len(messages), self._delivery_timeout, record_acks)
        for index, message in enumerate(messages):
            while True:
                try:
                    self._producer.produce(
                        message.topic,
                        message.value,
                        message.key,
                        headers=message.headers,
                        on_delivery=sending.reporter(index, self._delivered),
                    )
                    sending.pending += 1
                    break
                except BufferError:
                    self._producer.poll(0.05)  # local queue full: serve delivery reports, then try again
                except KafkaException as exc:
                    error = exc.args[0]
                    sending.results[index] = Delivery(classify(error.code(), error.fatal()), error.str())
                    break
        return sending

    def close(self, timeout: float) -> None:
        self._producer.flush(timeout)


def _undecided(verdict: Delivery | None) -> bool:
    """The cluster's answer about a topic may still change (not there yet, no leader yet): ask again."""
    return verdict is not None and verdict.disposition is Disposition.RETRY
