"""Where a batch's rows come from: the seam between the relay daemon and the two ways of reading the outbox.

The daemon (lanes, leases, publishing, outcomes, metrics) asks a BatchSource for a lane's next page and
hands the page back with each row's outcome; it never asks which source it has. A source owns its SQL.
Both sources' reading statements return the same named columns (OutboxRecord's fields), checked by name
on every read (outbox_records), so neither can drift from the other or from the record unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import psycopg

from postbox.relay.outbox.routing import OutboxRow

if TYPE_CHECKING:
    from psycopg.rows import RowMaker

    from postbox.relay.outbox.exactly_once.settlement import Settlement
    from postbox.relay.outbox.outcome import BatchOutcome

Connection = psycopg.Connection[tuple[Any, ...]]


class RelayConfigurationError(RuntimeError):
    """A setting the database cannot honour, found once connected and before anything is claimed."""


class OutboxRecord(NamedTuple):
    """A row as a reading statement returns it: OutboxRow's fields with the headers still JSON text (loaded
    per row by the daemon's guarded step, where a value Python cannot load parks that row alone), and how
    many rows the statement took (more than it returned when the byte budget cut the page short)."""

    id: int
    event_id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: str | None
    payload_bytes: bytes | None
    headers: str | None  # JSON text; None when there are none
    topic: str | None
    shard: int
    created_epoch: float
    size: int
    claimed_rows: int

    def row(self, headers: dict[str, object] | None) -> OutboxRow:
        """The row with its headers loaded (`headers`); the field order is OutboxRow's (a unit test holds
        the two in step)."""
        return OutboxRow._make((*self[:7], headers, *self[8:12]))


RECORD_COLUMNS = OutboxRecord._fields


def outbox_records(cursor: psycopg.Cursor[Any]) -> RowMaker[OutboxRecord]:
    """psycopg row factory for the reading statements: OutboxRecords, after checking the statement's
    columns by name (once per statement, not per row)."""
    description = cursor.description
    if description is not None:
        names = tuple(column.name for column in description)
        if names != RECORD_COLUMNS:
            raise RuntimeError(f"a reading statement returned columns {names}, not {RECORD_COLUMNS}")
    make: Callable[[Sequence[Any]], OutboxRecord] = OutboxRecord._make
    return make


@dataclass(frozen=True)
class ReadLimits:
    """How much one page may hold, and what it must leave out (rows for topics held back)."""

    rows: int
    max_message_bytes: int  # a row over it comes without its payload: it is parked, never loaded
    max_batch_bytes: int
    blocked_topics: list[str]
    blocked_types: list[str]  # aggregate types routed to a blocked topic by the topic template

    def params(self) -> dict[str, Any]:
        return {
            "limit": self.rows,
            "max_message_bytes": self.max_message_bytes,
            "max_batch_bytes": self.max_batch_bytes,
            "blocked_topics": self.blocked_topics,
            "blocked_types": self.blocked_types,
        }


class Page(Protocol):
    """A lane's rows read in the batch's open transaction, and how their outcomes are written back."""

    records: list[OutboxRecord]

    @property
    def claimed(self) -> int:
        """Rows the read took: len(records), or more when the byte budget cut the page short."""
        ...

    @property
    def read_past(self) -> bool:
        """Whether a cursor reads past these rows: then a row held back holds its aggregate (later events of
        it wait), and a shard's rows after one that cannot be sent now wait with it. Rows claimed one by
        one stay pending each on its own."""
        ...

    def mark(self, conn: Connection, outcome: BatchOutcome) -> int:
        """Write each row's outcome in the batch's transaction (not committed here), fenced on the shard
        leases; the rows whose shard was still ours."""
        ...

    def settlements(self, groups: Collection[int], outcome: BatchOutcome) -> dict[int, Settlement]:
        """What mark() would write for `outcome`, split by group of shards, for each of `groups`: what an
        exactly-once batch's transaction for that group carries (a page may span several groups)."""
        ...


class BatchSource(Protocol):
    """Where a lane's batches come from."""

    @property
    def name(self) -> str:
        """The outbox's mode this source reads: `queue` or `log`."""
        ...

    @property
    def rows_per_batch(self) -> int:
        """--batch-size, or this source's default."""
        ...

    def read(self, conn: Connection, lane: list[int], limits: ReadLimits) -> Page | None:
        """The lane's next page, read in a transaction opened on `conn`; None when there is nothing to
        send (the caller commits either way)."""
        ...

    def look_again_in(self) -> float | None:
        """Seconds until the relay should read again although nothing woke it, or None."""
        ...

    def upkeep(self, conn: Connection) -> None:
        """The source's own periodic upkeep and gauges, on the housekeeping thread's connection."""
        ...

    def close(self, conn: Connection) -> None:
        """The relay stops reading from this source (a clean stop, or it follows the outbox to the other
        mode): write down what only memory holds, on `conn` (autocommit, leases still ours)."""
        ...
