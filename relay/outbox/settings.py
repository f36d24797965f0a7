"""The relay's settings, validated once at start. Pure: building them does no I/O."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta

from relay.core.db import check_database_url
from relay.outbox.routing import DEFAULT_TOPIC_TEMPLATE, validate_topic_template


class SettingsError(ValueError):
    """A setting is invalid; the message starts with the setting's name."""


# The relay's safety rests on these producer settings; a pass-through value may not weaken them.
_REQUIRED_PRODUCER = {"enable.idempotence": "true", "acks": "all"}
DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's message.max.bytes


@dataclass(frozen=True)
class RelaySettings:
    database_url: str
    kafka_bootstrap: str
    schema: str = "postbox"
    relay_id: str = field(default_factory=lambda: f"{socket.gethostname()[:40]}-{os.getpid()}")
    batch_size: int = 1000
    lanes: int = 2  # batches in flight at once, each on its own shards and connection
    poll_interval: float = 1.0
    listen: bool = True
    lease_ttl: float = 15.0
    delivery_timeout: float = 20.0
    topic_template: str = DEFAULT_TOPIC_TEMPLATE
    prune_retention: timedelta | None = None
    delete_on_publish: bool = False  # delete a row in the mark statement instead of marking it published
    prune_interval: float = 60.0
    topic_recheck_interval: float = 30.0
    # Sent by default so the inbox can dispatch (Debezium consumers ignore an extra header); "" turns it off
    # for exactly the Debezium router's default wire format.
    event_type_header: str = "eventType"
    # Bytes of messages one claim loads (per lane; the first row always comes). With two lanes in flight and
    # the copies psycopg, Python and librdkafka each hold, 16 MiB keeps the relay well inside the shipped
    # 256Mi pod limit, whatever the rows hold.
    max_batch_bytes: int = 16 << 20
    kafka_config: dict[str, str] = field(default_factory=dict)

    @property
    def max_message_bytes(self) -> int:
        """The producer's message.max.bytes (librdkafka's default unless passed through): a row over it is
        parked by the claim without being loaded."""
        return int(self.kafka_config.get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES))

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise SettingsError(message)

        check(bool(self.database_url), "database-url: required (POSTBOX_DATABASE_URL)")
        try:
            check_database_url(self.database_url)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        check(bool(self.kafka_bootstrap), "kafka-bootstrap: required (POSTBOX_KAFKA_BOOTSTRAP)")
        check(1 <= self.batch_size <= 10_000, f"batch-size: {self.batch_size} is outside 1..10000")
        check(1 <= self.lanes <= 8, f"lanes: {self.lanes} is outside 1..8")
        check(
            1 << 20 <= self.max_batch_bytes <= 1 << 30,
            f"max-batch-bytes: {self.max_batch_bytes} is outside 1 MiB..1 GiB",
        )
        raw_max = self.kafka_config.get("message.max.bytes", str(DEFAULT_MESSAGE_MAX_BYTES))
        check(
            raw_max.isascii() and raw_max.isdigit() and 1000 <= int(raw_max) <= 1_000_000_000,
            f"kafka-config message.max.bytes={raw_max}: not a number of bytes in 1000..1000000000",
        )
        check(0.05 <= self.poll_interval <= 60, f"poll-interval: {self.poll_interval}s is outside 0.05..60")
        check(1 <= self.lease_ttl <= 600, f"lease-ttl: {self.lease_ttl}s is outside 1..600")
        check(
            1 <= self.delivery_timeout <= 900, f"delivery-timeout: {self.delivery_timeout}s is outside 1..900"
        )
        check(
            bool(re.fullmatch(r"[A-Za-z0-9_.:-]{1,48}", self.relay_id)),
            f"relay-id: {self.relay_id!r} must be 1-48 of A-Z a-z 0-9 _ . : - "
            "(it names the relay's sessions in pg_stat_activity)",
        )
        check(
            0.1 <= self.prune_interval <= 86_400,
            f"prune-interval: {self.prune_interval}s is outside 0.1..86400",
        )
        if self.prune_retention is not None:
            check(self.prune_retention > timedelta(0), "prune-retention: must be positive")
        try:
            validate_topic_template(self.topic_template)
        except ValueError as exc:
            raise SettingsError(f"topic-template: {exc}") from None
        for key, required in _REQUIRED_PRODUCER.items():
            given = self.kafka_config.get(key)
            if given is not None and given.lower() != required:
                raise SettingsError(f"kafka-config {key}={given}: the relay requires {key}={required}")

    def producer_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka settings: safe defaults, then the user's pass-through, then the non-negotiables."""
        config: dict[str, str | int | float | bool] = {
            "bootstrap.servers": self.kafka_bootstrap,
            "client.id": f"postbox-relay-{self.relay_id}",
            # murmur2 like the Java client (and so Debezium): a key lands on the same partition either way.
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "compression.type": "lz4",
            "message.timeout.ms": int(self.delivery_timeout * 1000),
            "queue.buffering.max.messages": max(100_000, self.batch_size * self.lanes * 4),
            "statistics.interval.ms": 15_000,  # feeds the queue-depth, round-trip and retry gauges
        }
        config.update(self.kafka_config)
        config.update(_REQUIRED_PRODUCER)
        return config
