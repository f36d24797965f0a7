"""Install, list, remove and snapshot captures: thin calls of the SQL functions migration 0012 creates,
so the command and a team's own migration tool do exactly the same thing."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from postbox.relay import __version__

# What a capture writes in each event's source.version: which postbox rendered it.
SOURCE_VERSION = f"postbox-{__version__}"

Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class CaptureOptions:
    """How `capture add` renders a table's changes; option names as Debezium's."""

    topic_prefix: str = "postbox"
    columns: Sequence[str] | None = None
    exclude_columns: Sequence[str] | None = None
    key_columns: Sequence[str] | None = None
    tombstones_on_delete: bool = True
    decimal_handling_mode: str = "precise"
    time_precision_mode: str = "adaptive"

    def debezium_options(self) -> dict[str, str]:
        """The options that differ from Debezium's defaults (this class's), by Debezium's names: what is
        stored with the capture."""
        defaults = CaptureOptions()._by_debezium_name()
        return {name: value for name, value in self._by_debezium_name().items() if defaults[name] != value}

    def _by_debezium_name(self) -> dict[str, str]:
        return {
            "tombstones.on.delete": "true" if self.tombstones_on_delete else "false",
            "decimal.handling.mode": self.decimal_handling_mode,
            "time.precision.mode": self.time_precision_mode,
        }


@dataclass(frozen=True)
class Capture:
    """One row of `postbox capture list`."""

    table: str
    topic: str
    key_columns: list[str]
    columns: list[str] | None
    exclude_columns: list[str] | None
    options: dict[str, str]
    added_at: datetime
    snapshot: str
    snapshot_done_at: datetime | None


def column_list(text: str) -> list[str]:
    """`a,b` → ["a", "b"]: a flag's comma-separated column names (spaces around names are dropped)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError(f"{text!r}: name each column, separated by commas")
    return names


def add_capture(conn: Connection, schema: str, table: str, options: CaptureOptions) -> str:
    """Capture `table` (SCHEMA.TABLE or a name on the search path), in the caller's transaction; returns
    the topic its events go to. Adding again replaces the settings."""
    row = conn.execute(
        sql.SQL("SELECT {}.capture_add(%s::regclass, %s, %s, %s, %s, %s::jsonb, %s)").format(
            sql.Identifier(schema)
        ),
        (
            table,
            options.topic_prefix,
            _array(options.columns),
            _array(options.exclude_columns),
            _array(options.key_columns),
            json.dumps(options.debezium_options()),
            SOURCE_VERSION,
        ),
    ).fetchone()
    assert row is not None
    return str(row[0])


def remove_capture(conn: Connection, schema: str, table: str) -> bool:
    """Stop capturing `table`; False when it was not captured. Events already written are still published."""
    row = conn.execute(
        sql.SQL("SELECT {}.capture_remove(%s::regclass)").format(sql.Identifier(schema)), (table,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def list_captures(conn: Connection, schema: str) -> list[Capture]:
    rows = conn.execute(
        sql.SQL(
            "SELECT captured_table, topic, key_columns, columns, exclude_columns, options, added_at, "
            "snapshot, snapshot_done_at FROM {}.outbox_captures ORDER BY captured_table"
        ).format(sql.Identifier(schema))
    ).fetchall()
    return [Capture(*row) for row in rows]


def snapshot(
    conn: Connection,
    schema: str,
    table: str,
    *,
    chunk_rows: int = 1000,
    restart: bool = False,
    progress: Callable[[int], object] = lambda emitted: None,
) -> int:
    """Emit every row of `table` as a read event (op r), one committed chunk at a time; returns how many
    this call emitted. Resumes after the last committed chunk: a crash costs at most one chunk again."""
    call = sql.SQL("SELECT {}.capture_snapshot_chunk(%s::regclass, %s, %s)").format(sql.Identifier(schema))
    total = 0
    first = True
    while True:
        with conn.transaction():
            row = conn.execute(call, (table, chunk_rows, restart and first)).fetchone()
        assert row is not None
        first = False
        emitted = int(row[0])
        total += emitted
        progress(total)
        if emitted < chunk_rows:
            return total


def _array(names: Sequence[str] | None) -> list[str] | None:
    return None if names is None else list(names)
