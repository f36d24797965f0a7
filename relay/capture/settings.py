"""The settings of `postbox capture ...` (flags and their environment variables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from postbox.relay.core.settings import DatabaseSettings, setting
from postbox.relay.outbox.settings import check_schema_setting


@dataclass(frozen=True, kw_only=True)
class CaptureSettings(DatabaseSettings):
    """`postbox capture list | remove`."""

    PREFIX: ClassVar[str] = "POSTBOX_CAPTURE_"

    def check(self) -> None:
        check_schema_setting(self)


@dataclass(frozen=True, kw_only=True)
class CaptureAddSettings(CaptureSettings):
    """`postbox capture add`."""

    topic_prefix: str = setting(
        "postbox",
        "the first part of the topic names (Debezium's topic.prefix): a table's events go to "
        "PREFIX.SCHEMA.TABLE",
    )
    decimal_handling_mode: str = setting(
        "precise",
        "numeric and money columns as Debezium's decimal.handling.mode renders them: precise (the unscaled "
        "value in base64), double or string",
        choices=("precise", "double", "string"),
    )
    time_precision_mode: str = setting(
        "adaptive",
        "time and timestamp columns as Debezium's time.precision.mode renders them",
        choices=("adaptive", "adaptive_time_microseconds", "connect"),
    )
    tombstones_on_delete: bool = setting(
        True,
        "after each delete, a tombstone (a null value with the row's key) so compaction can drop the key "
        "(Debezium's tombstones.on.delete)",
    )


@dataclass(frozen=True, kw_only=True)
class CaptureSnapshotSettings(CaptureSettings):
    """`postbox capture snapshot`."""

    chunk_rows: int = setting(
        1000,
        "rows per chunk: each chunk's rows are read, locked and written as events in one transaction",
        env="POSTBOX_CAPTURE_SNAPSHOT_CHUNK_ROWS",
        bounds=(1, 1_000_000),
    )
