"""Operator actions on the outbox: migrating, status, requeue of parked rows, switching modes, pruning.
Shared by the CLI and daemon."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg

from relay.core.batched import delete_in_batches
from relay.core.migrate import Migration, migrate
from relay.core.sql import query
from relay.outbox.log_reader import shards_behind_switch, take_tick

QUERIES = Path(__file__).with_name("queries.sql")


@dataclass(frozen=True)
class Status:
    backlog: int
    oldest_pending_seconds: float
    failed: int  # rows parked: in state failed
    unowned_shards: int
    owners: list[tuple[str, int, float]]  # (relay id, shards held, seconds until the earliest expiry)
    partitions: int  # the outbox's partitions by txid, besides outbox_default and outbox_parked
    partitions_finished: int  # of which finished: every row published or read, waiting for the retention


def status(conn: psycopg.Connection[tuple[object, ...]]) -> Status:
    backlog = conn.execute(query(QUERIES, "backlog")).fetchone()
    unowned = conn.execute(query(QUERIES, "unowned_shards")).fetchone()
    assert backlog is not None
    assert unowned is not None
    partitions = conn.execute(query(QUERIES, "partitions")).fetchone()
    assert partitions is not None
    owners = [
        (str(o), int(str(c)), float(str(e))) for o, c, e in conn.execute(query(QUERIES, "shard_owners"))
    ]
    return Status(
        int(str(backlog[0])),
        float(str(backlog[1])),
        int(str(backlog[2])),
        int(str(unowned[0])),
        owners,
        int(str(partitions[0])),
        int(str(partitions[1])),
    )


def requeue(
    conn: psycopg.Connection[tuple[object, ...]],
    *,
    ids: list[int] | None = None,
    aggregate_type: str | None = None,
    event_type: str | None = None,
    error_like: str | None = None,
) -> list[int]:
    """Put parked rows back to pending (all filters given must match); returns their ids."""
    with conn.transaction():
        rows = conn.execute(
            query(QUERIES, "requeue"),
            {
                "ids": ids,
                "aggregate_type": aggregate_type,
                "event_type": event_type,
                "error_like": error_like,
            },
        )
        return sorted(int(str(r[0])) for r in rows)


class SwitchRefused(RuntimeError):
    """The outbox could not be locked for a switch of modes in time (relays or writers hold it)."""


@dataclass(frozen=True)
class LogProgress:
    tick_age_seconds: float  # the newest tick's age
    oldest_open_transaction_seconds: float
    cursor_lag_seconds: dict[int, float]  # shard -> behind the newest tick; only shards ever switched
    shards_behind_switch: int  # after a switch back to queue mode: shards whose log is not read to it


@dataclass(frozen=True)
class LogBacklog:
    rows: int  # logged rows not yet published (a window being read counts until it is finished)
    oldest_seconds: float


def log_progress(conn: psycopg.Connection[tuple[object, ...]]) -> LogProgress:
    ages = conn.execute(query(QUERIES, "log_ages")).fetchone()
    assert ages is not None
    lag = {int(str(s)): float(str(v)) for s, v in conn.execute(query(QUERIES, "log_cursor_lag"))}
    return LogProgress(float(str(ages[0])), float(str(ages[1])), lag, shards_behind_switch(conn))


def log_backlog(conn: psycopg.Connection[tuple[object, ...]]) -> LogBacklog:
    """For `postbox relay status`: it reads every unpublished logged row, so the daemon does not run it."""
    found = conn.execute(query(QUERIES, "log_backlog")).fetchone()
    assert found is not None
    return LogBacklog(int(str(found[0])), float(str(found[1])))


def switch_mode(
    conn: psycopg.Connection[tuple[object, ...]], schema: str, mode: str, lock_timeout: float = 5.0
) -> int:
    """Switch the outbox to log or queue mode in one transaction; returns the switch's tick. The relays
    must be stopped: each open batch holds a lock on the outbox, and one relay's lanes would wait for each
    other behind this switch's lock (SwitchRefused after lock_timeout; writers wait that long at most).

    Writers wait for the table lock, so every row written before the switch has the old mode's state and
    every row after it the new one. To log mode: every cursor starts at this tick (rows visible in its
    snapshot are the queue's, still pending or published), and a shard's pending rows are claimed before
    its log is read. To queue mode: the cursors stay, and a shard's pending rows are claimed only once
    relays in log mode have read its log to this tick (all logged rows are visible in it)."""
    if mode not in ("log", "queue"):
        raise ValueError(f"mode must be log or queue, not {mode!r}")
    with conn.transaction():
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout * 1000)}ms",))
        try:
            conn.execute(query(QUERIES, "log_switch_lock"))
        except psycopg.errors.LockNotAvailable:
            raise SwitchRefused(
                f"could not lock the outbox within {lock_timeout:g} s: stop the relays first (writers may go "
                "on; a long-running writer's transaction must end)"
            ) from None
        conn.execute("SELECT set_config('lock_timeout', '0', true)")
        conn.execute(query(QUERIES, "log_switch_to_log" if mode == "log" else "log_switch_to_queue"))
        _, newest = take_tick(conn, schema, 0.0, wait=True)
        assert newest is not None
        tick = newest
        if mode == "log":
            conn.execute(query(QUERIES, "log_start_cursors"), {"tick": tick})
        conn.execute(query(QUERIES, "log_record_switch"), {"mode": mode, "tick": tick})
        return tick


def migrate_schema(
    conn: psycopg.Connection[tuple[object, ...]], schema: str, new_outbox_mode: str
) -> list[Migration]:
    """`postbox migrate`: create or upgrade `schema`'s tables. An outbox this call creates starts in
    `new_outbox_mode`; log mode is switched on in the creating transaction, so no relay (and no writer)
    ever sees the new outbox in queue mode. An outbox that exists keeps its mode: switching one needs
    its relays stopped (switch_mode)."""
    if new_outbox_mode not in ("log", "queue"):
        raise ValueError(f"new_outbox_mode must be log or queue, not {new_outbox_mode!r}")

    def start_in_log_mode(created: psycopg.Connection[tuple[object, ...]]) -> None:
        switch_mode(created, schema, "log")

    return migrate(conn, schema, on_create=start_in_log_mode if new_outbox_mode == "log" else None)


def prune(
    conn: psycopg.Connection[tuple[object, ...]],
    retention: timedelta,
    batch_size: int = 1000,
    max_batches: int | None = None,
) -> Pruned:
    """Empty the outbox partitions finished for longer than `retention` (log mode's only retention: no row
    deletes), then delete the rows published in queue mode older than it, a small batch per transaction.

    A row still to publish, a logged row a cursor has not passed, or a parked one is never removed.
    """
    partitions = maintain_partitions(conn, None, retention)  # first: whole partitions cost no row deletes
    deleted = delete_in_batches(
        conn, query(QUERIES, "prune_batch"), {"retention": retention}, batch_size, max_batches
    )
    return Pruned(deleted, partitions)


@dataclass(frozen=True)
class PartitionUpkeep:
    created: int  # partitions created ahead
    done: int  # partitions found finished (every row published or read)
    emptied: int  # truncated (finished for longer than the retention)
    dropped: int
    parked_moved: int  # parked rows moved out of an emptied partition to outbox_parked

    @property
    def changed(self) -> bool:
        return any((self.created, self.done, self.emptied, self.dropped, self.parked_moved))


@dataclass(frozen=True)
class Pruned:
    rows: int  # published rows deleted one by one (queue mode)
    partitions: PartitionUpkeep


def maintain_partitions(
    conn: psycopg.Connection[tuple[object, ...]],
    xids_per_partition: int | None,
    retention: timedelta | None,
) -> PartitionUpkeep:
    """One run of outbox_maintain_partitions (its own transaction): partitions ahead of the txids in use
    (none with `xids_per_partition` None), and with a retention, finished partitions emptied whole."""
    with conn.transaction():
        found = conn.execute(
            query(QUERIES, "maintain_partitions"),
            {"xids_per_partition": xids_per_partition, "retention": retention},
        ).fetchone()
    assert found is not None
    return PartitionUpkeep(*(int(str(v or 0)) for v in found))
