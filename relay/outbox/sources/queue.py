"""Queue mode's source: claim a lane's pending rows (FOR UPDATE SKIP LOCKED, under a per-shard advisory
lock) and mark each with its outcome, in the batch's transaction. Log mode claims this way too, for the
rows that are pending in a log-mode outbox (from before a switch, or requeued)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from postbox.relay.core.db import advisory_key
from postbox.relay.core.sql import query
from postbox.relay.outbox.exactly_once.groups import group_of
from postbox.relay.outbox.exactly_once.settlement import Settlement
from postbox.relay.outbox.outcome import BatchOutcome, RowOutcome, RowState
from postbox.relay.outbox.settings import QUEUE_BATCH_ROWS, RelaySettings
from postbox.relay.outbox.sources.base import Connection, OutboxRecord, ReadLimits, outbox_records

QUERIES = Path(__file__).parent.parent / "queries.sql"


@dataclass(frozen=True)
class Claimer:
    """The claim and the mark, shared by both sources."""

    relay_id: str
    lock_space: int  # the advisory-lock space of the shards' claim locks (per schema)
    delete_on_publish: bool

    @classmethod
    def of(cls, settings: RelaySettings) -> Claimer:
        """The relay's claimer, as its settings make it."""
        lock_space = advisory_key("postbox.relay", settings.schema) & 0x7FFFFFFF
        return cls(settings.relay_id, lock_space, settings.delete_on_publish)

    def claim(self, conn: Connection, lane: list[int], limits: ReadLimits) -> ClaimedPage | None:
        params = {**limits.params(), "shards": lane, "lock_space": self.lock_space}
        with conn.cursor(row_factory=outbox_records) as cursor:
            records = cursor.execute(query(QUERIES, "claim_batch"), params).fetchall()
        return ClaimedPage(records, self) if records else None

    def mark(self, conn: Connection, outcome: BatchOutcome) -> int:
        return self.mark_rows(conn, outcome.rows)

    def mark_rows(self, conn: Connection, rows: Sequence[RowOutcome]) -> int:
        """Write these outcomes to their rows, those still pending and of shards still ours."""
        return conn.execute(
            query(QUERIES, "mark_batch_deleting" if self.delete_on_publish else "mark_batch"),
            {
                "relay_id": self.relay_id,
                "ids": [o.row_id for o in rows],
                "states": [o.state.value for o in rows],
                "errors": [o.error for o in rows],
            },
        ).rowcount


@dataclass
class ClaimedPage:
    records: list[OutboxRecord]
    claimer: Claimer

    @property
    def claimed(self) -> int:
        return int(self.records[0].claimed_rows)

    @property
    def read_past(self) -> bool:
        return False  # each row stays pending on its own

    def mark(self, conn: Connection, outcome: BatchOutcome) -> int:
        return self.claimer.mark(conn, outcome)

    def settlements(self, groups: Collection[int], outcome: BatchOutcome) -> dict[int, Settlement]:
        marked: dict[int, list[RowOutcome]] = {g: [] for g in groups}
        for row, record in zip(outcome.rows, self.records, strict=True):
            if row.state is not RowState.PENDING and (group := group_of(record.shard)) in marked:
                marked[group].append(row)
        return {g: Settlement(g, self.claimer.relay_id, marked=tuple(marked[g])) for g in groups}


class QueueSource:
    name = "queue"

    def __init__(self, claimer: Claimer, batch_size: int | None) -> None:
        self._claimer = claimer
        self.rows_per_batch = batch_size or QUEUE_BATCH_ROWS

    def read(self, conn: Connection, lane: list[int], limits: ReadLimits) -> ClaimedPage | None:
        return self._claimer.claim(conn, lane, limits)

    def look_again_in(self) -> float | None:
        return None  # a committed row is claimable at once: its NOTIFY, or the poll interval, is enough

    def upkeep(self, conn: Connection) -> None:
        pass  # the queue has no state of its own beyond the rows

    def close(self, conn: Connection) -> None:
        pass
