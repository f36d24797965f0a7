"""The relay's settings, validated once at start. Pure: building them does no I/O."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from postbox.relay.core.redact import redact
from postbox.relay.core.settings import (
    DatabaseSettings,
    Renamed,
    Settings,
    SettingsError,
    duration,
    integer,
    setting,
    shared_database_url,
    shared_kafka_bootstrap,
    shared_kafka_config,
    shared_metrics_address,
    shared_schema,
)
from postbox.relay.core.sql import check_schema_name
from postbox.relay.outbox.routing import DEFAULT_TOPIC_TEMPLATE, ID_HEADER, validate_topic_template

# The relay's safety rests on these producer settings; a pass-through value may not weaken them.
_REQUIRED_PRODUCER = {"enable.idempotence": "true", "acks": "all"}
DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's message.max.bytes
DEFAULT_PARTITION_XIDS = 4_194_304
# --batch-size's defaults, measured (tests/bench, 1M-row drains, 200 B, two runs each): log mode drained
# 66,831/s at 1000 and 82,947/s at 4000 (2500: 81,200; 5000: 82,738; 10000: 76,617); queue mode 37,081/s
# at 1000 and 32,534/s at 4000, with the whole machine's CPU up from 47 to 57 s.
QUEUE_BATCH_ROWS = 1000
LOG_BATCH_ROWS = 4000


def mode_to_follow(outbox_in_log_mode: bool, shards_behind_switch: int) -> str:
    """--mode auto's choice: log while the outbox is in log mode, and after a switch back to queue mode
    until every shard's log is read to the switch (a queue relay cannot read it, and refuses to start);
    queue otherwise."""
    return "log" if outbox_in_log_mode or shards_behind_switch else "queue"


def check_schema_setting(settings: Settings) -> None:
    """SettingsError naming --schema when postbox cannot keep its tables in a schema of that name."""
    schema = getattr(settings, "schema", None)
    if schema is None:
        return
    try:
        check_schema_name(schema)
    except ValueError as exc:
        raise SettingsError(f"{settings.label('schema')}: {exc}") from None


def _default_relay_id() -> str:
    return f"{socket.gethostname()[:40]}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class RelaySettings(Settings):
    """`postbox relay run`. Earlier names (POSTBOX_LEASE_TTL...) are read for one more release."""

    PREFIX: ClassVar[str] = "POSTBOX_RELAY_"
    SERVICE: ClassVar[str] = "relay"

    database_url: str = shared_database_url()
    schema: str = shared_schema()
    kafka_bootstrap: str = shared_kafka_bootstrap()
    kafka_config: dict[str, str] = shared_kafka_config()
    relay_id: str = setting(
        None,
        "this replica's name in the lease table; a second live replica with the same id waits (unready) "
        "instead of sharing its leases",
        parse=str,
        env="POSTBOX_RELAY_ID",
        factory=_default_relay_id,
        shown_default="hostname-pid",
    )
    mode: str = setting(
        "auto",
        "auto: the outbox's own mode, read at each lease renewal (log once it is switched to log mode with "
        "`postbox relay switch-mode log`, and after a switch back until its log is read, then queue; queue "
        "otherwise); "
        "queue: claim each row and mark it published; log: read the outbox as an append-only log in commit "
        "order, a cursor per shard and no write per row",
        choices=("auto", "queue", "log"),
    )
    tick_interval: float = setting(
        0.01,
        "log mode: the least seconds between two snapshots (ticks) the relays take; a row waits for the "
        "first tick after its commit",
        bounds=(0.001, 60),
    )
    partition_xids: int = setting(
        DEFAULT_PARTITION_XIDS,
        "transaction ids per outbox partition: the relay creates partitions up to two widths ahead of the "
        "ids in use and, with --prune-retention, empties finished partitions whole instead of deleting rows",
        bounds=(16, 1 << 31),
    )
    batch_size: int | None = setting(
        None,
        "rows claimed per batch (per lane); log mode's larger default spreads a batch's fixed costs "
        "(statements, the wait for acks) over more rows",
        parse=integer,
        bounds=(1, 10_000),
        retired=("POSTBOX_BATCH_SIZE",),
        shown_default="1000 (queue) / 4000 (log)",
    )
    max_batch_bytes: int = setting(
        # With two lanes in flight and the copies psycopg, Python and librdkafka each hold, 16 MiB keeps the
        # relay well inside the shipped 256Mi pod limit, whatever the rows hold.
        16 << 20,
        "bytes of messages one claim loads (per lane; a batch is cut short there, the first row always "
        "comes); rows over the producer's message.max.bytes are parked without being loaded",
        bounds=(1 << 20, 1 << 30),
    )
    lanes: int = setting(
        2,
        "batches in flight at once, each on its own shards, database connection and thread: while one waits "
        "(for PostgreSQL, for Kafka's acks) another reads its rows and produces (1 = one batch at a time); "
        "with --exactly-once a group of shards stays in one lane, and 8 gives each group its own, which "
        "drains a backlog faster at some cost in latency",
        bounds=(1, 8),
    )
    poll_interval: float = setting(
        1.0, "seconds between polls when idle", bounds=(0.05, 60), renamed=(Renamed("POSTBOX_POLL_INTERVAL"),)
    )
    listen: bool = setting(
        True,
        "LISTEN for NOTIFY wake-ups (--no-listen: poll only)",
        renamed=(Renamed("POSTBOX_NO_LISTEN", negated=True),),
    )
    lease_ttl: float = setting(
        15.0,
        "seconds a shard lease lasts without renewal (the failover time)",
        bounds=(1, 600),
        renamed=(Renamed("POSTBOX_LEASE_TTL"),),
    )
    delivery_timeout: float = setting(
        20.0,
        "seconds Kafka may take to acknowledge (message.timeout.ms)",
        bounds=(1, 900),
        renamed=(Renamed("POSTBOX_DELIVERY_TIMEOUT"),),
    )
    topic_template: str = setting(
        DEFAULT_TOPIC_TEMPLATE,
        "topic for rows without an explicit topic",
        renamed=(Renamed("POSTBOX_TOPIC_TEMPLATE"),),
    )
    event_type_header: str = setting(
        # Sent by default so the inbox can dispatch (Debezium consumers ignore an extra header).
        "eventType",
        "also send the event type in this header, which the inbox dispatches on; Debezium consumers "
        "ignore it ('' turns it off: the Debezium router's exact default format)",
        renamed=(Renamed("POSTBOX_EVENT_TYPE_HEADER"),),
    )
    topic_recheck_interval: float = setting(
        30.0,
        "seconds between checks of a topic held back by a configuration error",
        bounds=(0.1, 3600),
        renamed=(Renamed("POSTBOX_TOPIC_RECHECK_INTERVAL"),),
    )
    prune_retention: timedelta | None = setting(
        None,
        "while running, empty outbox partitions finished for longer than this (e.g. 7d) and delete "
        "published rows older than it; off when unset",
        parse=duration,
        bounds=(1, 1e9),
        renamed=(Renamed("POSTBOX_PRUNE_RETENTION"),),
    )
    prune_interval: float = setting(
        60.0,
        "seconds between the daemon's pruning runs (with --prune-retention)",
        bounds=(0.1, 86_400),
        renamed=(Renamed("POSTBOX_PRUNE_INTERVAL"),),
    )
    delete_on_publish: bool = setting(
        False,
        "delete each row once Kafka has acknowledged it, in the statement that would mark it published "
        "(cheaper than an update; keeps no published rows; needs GRANT DELETE on the outbox)",
        renamed=(Renamed("POSTBOX_DELETE_ON_PUBLISH"),),
    )
    exactly_once: bool = setting(
        False,
        "log mode: publish each batch in one Kafka transaction with its cursors, through a transactional "
        "producer per group of 8 shards, so that read_committed consumers see every event once through "
        "crashes and failovers (a queue-mode relay refuses it)",
    )
    transactional_id_prefix: str | None = setting(
        None,
        "--exactly-once: the groups' transactional.id is PREFIX-<group> and their cursor topic "
        "PREFIX.cursors; each outbox on a Kafka cluster needs its own (the default is)",
        parse=str,
        shown_default="postbox.<schema>.<outbox id>",
    )
    metrics_address: str = shared_metrics_address("0.0.0.0:9400")

    def transactional_prefix(self, outbox_id: str) -> str:
        """--exactly-once: the groups' transactional.id prefix (their cursor topic is PREFIX.cursors): as
        given, or named after the schema and the outbox's own id (migration 0013), so that two outboxes on
        one Kafka cluster never share it."""
        return self.transactional_id_prefix or f"postbox.{self.schema}.{outbox_id[:8]}"

    def transactional_config(self) -> dict[str, str | int | float | bool]:
        """--exactly-once: the producer settings of the groups' transactional producers (each adds its
        transactional.id). An open transaction is aborted by the broker after transaction.timeout.ms,
        which must cover the delivery timeout."""
        config = self.producer_config()
        # At most the broker's default transaction.max.timeout.ms (15 min), where a longer one is refused.
        config.setdefault("transaction.timeout.ms", min(int(self.delivery_timeout * 1000) + 10_000, 900_000))
        # A group's next transaction begins right after its commit, while the coordinator still writes the
        # last one's markers: its AddPartitionsToTxn is refused (CONCURRENT_TRANSACTIONS) and retried after
        # retry.backoff.ms, which librdkafka grows to retry.backoff.max.ms (100 ms, then up to 1 s).
        # Both or neither: librdkafka refuses a maximum below the backoff.
        if not {"retry.backoff.ms", "retry.backoff.max.ms"} & self.kafka_config.keys():
            config.update({"retry.backoff.ms": 5, "retry.backoff.max.ms": 50})
        return config

    @property
    def max_message_bytes(self) -> int:
        """The producer's message.max.bytes (librdkafka's default unless passed through): a row over it is
        parked by the claim without being loaded."""
        return int(self.kafka_config.get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES))

    def effective_lines(self) -> list[str]:
        """For `config check`: the librdkafka configuration the producer gets."""
        return [f"  rdkafka {k} = {redact(k, str(v))}" for k, v in sorted(self.producer_config().items())]

    def check(self) -> None:
        raw_max = self.kafka_config.get("message.max.bytes", str(DEFAULT_MESSAGE_MAX_BYTES))
        if not (raw_max.isascii() and raw_max.isdigit() and 1000 <= int(raw_max) <= 1_000_000_000):
            raise SettingsError(
                f"kafka-config message.max.bytes={raw_max}: not a number of bytes in 1000..1000000000"
            )
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,48}", self.relay_id):
            raise SettingsError(
                f"{self.label('relay_id')}: {self.relay_id!r} must be 1-48 of A-Z a-z 0-9 _ . : - "
                "(it names the relay's sessions in pg_stat_activity)"
            )
        check_schema_setting(self)
        try:
            validate_topic_template(self.topic_template)
        except ValueError as exc:
            raise SettingsError(f"{self.label('topic_template')}: {exc}") from None
        if self.event_type_header == ID_HEADER or "\x00" in self.event_type_header:
            raise SettingsError(
                f"{self.label('event_type_header')}: {self.event_type_header!r} cannot name the event type's "
                f"header (the {ID_HEADER!r} header carries the event id consumers deduplicate on; no NUL)"
            )
        self._check_exactly_once()
        for key, required in _REQUIRED_PRODUCER.items():
            given = self.kafka_config.get(key)
            if given is not None and given.lower() != required:
                raise SettingsError(f"kafka-config {key}={given}: the relay requires {key}={required}")

    def _check_exactly_once(self) -> None:
        if "transactional.id" in self.kafka_config:
            raise SettingsError(
                "kafka-config transactional.id: the relay sets it per group of shards with --exactly-once "
                f"({self.label('transactional_id_prefix')} names them)"
            )
        if not self.exactly_once:
            return
        if self.mode == "queue":
            raise SettingsError(
                f"{self.label('exactly_once')} needs log mode: a queue-mode relay marks each row after its "
                "ack, which no Kafka transaction can include (run with --mode log or auto on an outbox "
                "switched to log mode: postbox relay switch-mode log)"
            )
        prefix = self.transactional_prefix("0" * 8)
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", prefix):
            raise SettingsError(
                f"{self.label('transactional_id_prefix')}: {prefix!r} must be 1-200 of A-Z a-z 0-9 . _ - "
                "(it names the cursor topic too)"
            )
        timeout = self.kafka_config.get("transaction.timeout.ms")
        if timeout is not None and not (timeout.isdigit() and int(timeout) >= self.delivery_timeout * 1000):
            raise SettingsError(
                f"kafka-config transaction.timeout.ms={timeout}: must be a number of milliseconds no less "
                f"than the delivery timeout ({int(self.delivery_timeout * 1000)} ms)"
            )

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
            # Built before `auto` is resolved: room for the larger default either way.
            "queue.buffering.max.messages": max(
                100_000, (self.batch_size or max(QUEUE_BATCH_ROWS, LOG_BATCH_ROWS)) * self.lanes * 4
            ),
            "statistics.interval.ms": 15_000,  # feeds the queue-depth, round-trip and retry gauges
        }
        config.update(self.kafka_config)
        config.update(_REQUIRED_PRODUCER)
        return config


@dataclass(frozen=True, kw_only=True)
class PruneSettings(DatabaseSettings):
    """`postbox relay prune`."""

    PREFIX: ClassVar[str] = "POSTBOX_RELAY_"

    older_than: timedelta = setting(
        timedelta(days=7),
        "empty outbox partitions finished for longer than this and delete published rows older than it",
        env="POSTBOX_RELAY_PRUNE_RETENTION",
        bounds=(1, 1e9),
        renamed=(Renamed("POSTBOX_PRUNE_RETENTION"),),
    )
    batch_size: int = setting(
        1000,
        "rows per delete (one transaction each)",
        env="POSTBOX_RELAY_PRUNE_BATCH_SIZE",
        bounds=(1, 100_000),
        renamed=(Renamed("POSTBOX_PRUNE_BATCH_SIZE"),),
    )

    def check(self) -> None:
        check_schema_setting(self)


@dataclass(frozen=True, kw_only=True)
class MigrateSettings(DatabaseSettings):
    """`postbox migrate`."""

    PREFIX: ClassVar[str] = "POSTBOX_MIGRATE_"

    new_outbox_mode: str = setting(
        "log",
        "the mode an outbox this run creates starts in (log: the faster, read as an append-only log; queue: "
        "each row claimed and marked); an existing outbox keeps its mode (`postbox relay switch-mode`)",
        choices=("log", "queue"),
    )

    def check(self) -> None:
        check_schema_setting(self)
