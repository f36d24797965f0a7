"""Operator actions on the outbox: migrating, status, requeue of parked rows, switching modes, pruning.
Shared by the CLI and daemon."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg

from postbox.relay.core.batched import delete_in_batches
from postbox.relay.core.migrate import Migration, migrate
from postbox.relay.core.sql import query
from postbox.relay.outbox.sources.log_reader import log_started, shards_behind_switch, take_tick

QUERIES = Path(__file__).with_name("queries.sql")


@dataclass(frozen=True)
class LogBacklog:
    rows: int  # logged rows not yet published (a window being read counts until it is finished)
    oldest_seconds: float


@dataclass(frozen=True)
class Stranded:
    """Committed rows no relay will ever read (see queries.sql, stranded_rows)."""

    rows: int
    first_ids: list[int]  # the lowest few, to name in `postbox relay status`


def stranded(conn: psycopg.Connection[tuple[object, ...]], show: int = 10) -> Stranded:
    found = conn.execute(query(QUERIES, "stranded_rows"), {"show": show}).fetchone()
    assert found is not None
    ids = found[1]
    assert isinstance(ids, list)
    return Stranded(int(str(found[0])), [int(str(i)) for i in ids])


@dataclass(frozen=True)
class Status:
    pending: int  # rows to claim (queue mode's, and requeued or queued ones in either mode)
    oldest_pending_seconds: float  # of those
    failed: int  # rows parked: in state failed
    unowned_shards: int
    owners: list[tuple[str, int, float]]  # (relay id, shards held, seconds until the earliest expiry)
    partitions: int  # the outbox's partitions by txid, besides outbox_default and outbox_parked
    partitions_finished: int  # of which finished: every row published or read, waiting for the retention
    # The census: what reads every partition of the outbox (a daemon takes it less often than the rest).
    stranded: Stranded | None = None  # committed rows no relay will ever read (None: not counted)
    log: LogBacklog | None = None  # logged rows not yet read (None: not counted, or never in log mode)

    @property
    def backlog(self) -> int:
        """Every row still to publish: pending, logged and unread, and stranded (which never will be)."""
        stranded = self.stranded.rows if self.stranded else 0
        return self.pending + (self.log.rows if self.log else 0) + stranded

    @property
    def oldest_unpublished_seconds(self) -> float:
        return max(self.oldest_pending_seconds, self.log.oldest_seconds if self.log else 0.0)


def status(conn: psycopg.Connection[tuple[object, ...]], *, census: bool = True) -> Status:
    """Where the outbox stands. `census`: count the stranded rows and the log's unread ones too; both
    read every partition of the outbox (and the log count every unread row), so a daemon takes the census
    less often (Relay._refresh_backlog_gauges)."""
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
        stranded(conn) if census else None,
        log_backlog(conn) if census and log_started(conn) else None,
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


def requeue_stranded(conn: psycopg.Connection[tuple[object, ...]]) -> list[int]:
    """Put the stranded rows (logged where no relay will read them: stranded_rows) in the queue, which
    relays claim in either mode; returns their ids."""
    with conn.transaction():
        conn.execute("SELECT set_config('postbox.rebase', 'on', true)")  # let them leave the log
        rows = conn.execute(query(QUERIES, "requeue_stranded")).fetchall()
        conn.execute("SELECT set_config('postbox.rebase', 'off', true)")
        return sorted(int(str(r[0])) for r in rows)


class SwitchRefused(RuntimeError):
    """The outbox could not be locked for a switch of modes in time (relays or writers hold it)."""


@dataclass(frozen=True)
class LogProgress:
    tick_age_seconds: float  # the newest tick's age
    oldest_open_transaction_seconds: float
    cursor_lag_seconds: dict[int, float]  # shard -> behind the newest tick; only shards ever switched
    shards_behind_switch: int  # after a switch back to queue mode: shards whose log is not read to it


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


def _lock_outbox(conn: psycopg.Connection[tuple[object, ...]], lock_timeout: float) -> None:
    """In the open transaction: the outbox locked against writers and relays for a switch of modes or a
    rebase (log_switch_lock), or SwitchRefused after `lock_timeout` seconds (writers wait that long)."""
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout * 1000)}ms",))
    try:
        conn.execute(query(QUERIES, "log_switch_lock"))
    except psycopg.errors.LockNotAvailable:
        raise SwitchRefused(
            f"could not lock the outbox within {lock_timeout:g} s: stop the relays first (writers may go "
            "on; a long-running writer's transaction must end)"
        ) from None
    conn.execute("SELECT set_config('lock_timeout', '0', true)")


def switch_mode(
    conn: psycopg.Connection[tuple[object, ...]], schema: str, mode: str, lock_timeout: float = 5.0
) -> int:
    """Switch the outbox to log or queue mode in one transaction; returns the switch's tick. The relays
    must be stopped: each open batch holds a lock on the outbox, and one relay's lanes would wait for each
    other behind this switch's lock (SwitchRefused after lock_timeout; writers wait that long at most).

    Writers wait for the table lock, so every row written before the switch has the old mode's state and
    every row after it the new one. To log mode: every cursor starts at this tick (rows visible in its
    snapshot are the queue's, still pending or published; logged rows no cursor had reached, from a log
    left unread at an earlier switch to queue mode, are queued), and a shard's pending rows are claimed
    before its log is read. To queue mode: the cursors stay, and a shard's pending rows are claimed only once
    relays in log mode have read its log to this tick (all logged rows are visible in it)."""
    if mode not in ("log", "queue"):
        raise ValueError(f"mode must be log or queue, not {mode!r}")
    with conn.transaction():
        _lock_outbox(conn, lock_timeout)
        conn.execute(query(QUERIES, "log_switch_to_log" if mode == "log" else "log_switch_to_queue"))
        # Writers' rows must take the new mode's state and no other (migration 0009's insert guard).
        conn.execute(query(QUERIES, "guard_writes"), {"state": "logged" if mode == "log" else "pending"})
        _, newest = take_tick(conn, schema, 0.0, wait=True)
        assert newest is not None
        tick = newest
        if mode == "log":
            with _rows_may_leave_the_log(conn):
                conn.execute(query(QUERIES, "log_unread_to_queue"))
            conn.execute(query(QUERIES, "log_start_cursors"), {"tick": tick})
        conn.execute(query(QUERIES, "log_record_switch"), {"mode": mode, "tick": tick})
        return tick


@contextlib.contextmanager
def _rows_may_leave_the_log(conn: psycopg.Connection[tuple[object, ...]]) -> Iterator[None]:
    """The write guard (migration 0009) lets logged rows leave the log only inside this, in the caller's
    transaction (the setting is transaction-local, so an error on the way out leaves nothing behind)."""
    conn.execute("SELECT set_config('postbox.rebase', 'on', true)")
    yield
    conn.execute("SELECT set_config('postbox.rebase', 'off', true)")


MOVED_DATABASE_HELP = (
    "run `postbox relay rebase` once, with the relays stopped (docs/how-to/move-the-database.md)"
)


def foreign_log(conn: psycopg.Connection[tuple[object, ...]]) -> str | None:
    """Why the outbox's log does not belong to this cluster (restored or replicated from another: its
    ticks were taken at a transaction counter this cluster has not reached), or None when it does."""
    found = conn.execute(query(QUERIES, "foreign_ticks")).fetchone()
    if found is None:
        return None
    tick, taken_at, here = found
    return (
        f"the outbox's log was written on another cluster: tick {tick} was taken at transaction {taken_at}, "
        f"and this cluster's counter stands at {here}; its snapshots would take every row written here for "
        f"long read, so no relay may read it: {MOVED_DATABASE_HELP}"
    )


class NothingToRebase(RuntimeError):
    """`postbox relay rebase` on an outbox whose log belongs to this cluster."""


@dataclass(frozen=True)
class Rebased:
    queued: int  # logged rows handed to the queue (unread, or not known to be read)
    published: int  # logged rows the old cluster had published
    tick: int  # the new log's first tick


def rebase(conn: psycopg.Connection[tuple[object, ...]], schema: str, lock_timeout: float = 5.0) -> Rebased:
    """After the database moved to another cluster (dump and restore, logical replication, a blue/green
    switch): restart the outbox's log on this cluster's transaction counter, in one transaction that holds
    the outbox locked (writers wait; the relays must be stopped, SwitchRefused otherwise). Every logged
    row leaves the log: to the queue (pending; relays claim those first, in id order, in either mode)
    unless the old cluster's own cursors say it was published; then the old ticks are forgotten, and
    every cursor starts at a tick taken here."""
    with conn.transaction():
        _lock_outbox(conn, lock_timeout)
        if foreign_log(conn) is None:
            raise NothingToRebase(
                "the outbox's log belongs to this cluster: nothing to rebase (stranded rows, if `postbox "
                "relay status` shows any, go back with `postbox relay requeue --stranded`)"
            )
        with _rows_may_leave_the_log(conn):
            states = [str(r[0]) for r in conn.execute(query(QUERIES, "rebase_unread_to_queue"))]
            conn.execute(query(QUERIES, "rebase_forget_ticks"))
            _, tick = take_tick(conn, schema, 0.0, wait=True)
            assert tick is not None
            conn.execute(query(QUERIES, "rebase_cursors"), {"tick": tick})
            conn.execute(query(QUERIES, "rebase_mode"), {"tick": tick})
        return Rebased(states.count("pending"), states.count("published"), tick)


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


def held_aggregates(conn: psycopg.Connection[tuple[object, ...]]) -> list[tuple[int, str, str]]:
    """(shard, aggregate id, topic) of every aggregate log mode holds for a topic (relay.outbox.held)."""
    return [(int(str(s)), str(a), str(t)) for s, a, t in conn.execute(query(QUERIES, "held_aggregates"))]


def requeue_held(conn: psycopg.Connection[tuple[object, ...]], topic: str) -> list[int]:
    """The rows held for `topic` (which now takes messages) back to the queue; their ids."""
    with conn.transaction():
        rows = conn.execute(query(QUERIES, "requeue_held"), {"topic": topic}).fetchall()
    return sorted(int(str(r[0])) for r in rows)
