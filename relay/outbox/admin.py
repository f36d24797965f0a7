"""Operator actions on the outbox: status, requeue of parked rows, pruning. Shared by the CLI and daemon."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg

from relay.core.batched import delete_in_batches
from relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")


@dataclass(frozen=True)
class Status:
    backlog: int
    oldest_pending_seconds: float
    failed: int  # rows parked: in state failed
    unowned_shards: int
    owners: list[tuple[str, int, float]]  # (relay id, shards held, seconds until the earliest expiry)


def status(conn: psycopg.Connection[tuple[object, ...]]) -> Status:
    backlog = conn.execute(query(QUERIES, "backlog")).fetchone()
    unowned = conn.execute(query(QUERIES, "unowned_shards")).fetchone()
    assert backlog is not None
    assert unowned is not None
    owners = [
        (str(o), int(str(c)), float(str(e))) for o, c, e in conn.execute(query(QUERIES, "shard_owners"))
    ]
    return Status(
        int(str(backlog[0])), float(str(backlog[1])), int(str(backlog[2])), int(str(unowned[0])), owners
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


def prune(
    conn: psycopg.Connection[tuple[object, ...]],
    retention: timedelta,
    batch_size: int = 1000,
    max_batches: int | None = None,
) -> int:
    """Delete published rows older than `retention`, a small batch per transaction; returns rows deleted.

    Only rows in state 'published' qualify: a pending or parked row is never deleted.
    """
    return delete_in_batches(
        conn, query(QUERIES, "prune_batch"), {"retention": retention}, batch_size, max_batches
    )
