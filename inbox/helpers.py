"""The article's building blocks for handlers, each tested on a real database.

- upsert_snapshot: a version-guarded snapshot upsert that refuses stale versions and tells insert from
  update (section 4);
- advisory_guard: a transaction-scoped 64-bit advisory lock, try-don't-wait, for heavy work (5.2);
- run_serializable: run a unit of work at a stricter isolation, retrying on SQLSTATE 40001/40P01 (7);
- prune_inbox: inbox retention in small batches, defaulting past the longest provider replay window (9).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import psycopg
import tenacity
from psycopg import sql

from postbox.relay.core.batched import delete_in_batches
from postbox.relay.core.db import advisory_key, database_unavailable, transient_database_error
from postbox.relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")
T = TypeVar("T")
Upserted = Literal["inserted", "updated", "stale"]

# Stripe resends manually for up to 30 days (plus 3 days of automatic retries); Marqeta a little over 12.
DEFAULT_INBOX_RETENTION = timedelta(days=60)


def _identifier(name: str) -> sql.Identifier:
    return sql.Identifier(*name.split("."))


def upsert_snapshot(
    tx: psycopg.Connection[Any],
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    version_column: str,
) -> Upserted:
    """Insert the row, or update it only if `values[version_column]` is newer than the stored version.

    Returns 'inserted', 'updated', or 'stale' (the stored row is as new or newer; nothing was written).
    A tie counts as stale, which makes an identical replay a no-op.
    """
    if version_column not in values:
        raise ValueError(f"values must include the version column {version_column!r}")
    columns = [*key, *values]
    statement = sql.SQL(
        "INSERT INTO {table} AS t ({columns}) VALUES ({placeholders}) "
        "ON CONFLICT ({key}) DO UPDATE SET {assignments} WHERE t.{version} < EXCLUDED.{version} "
        # xmax = 0 marks a freshly inserted row (an implementation detail, covered by a test on 15 and 18).
        "RETURNING (xmax = 0)"
    ).format(
        table=_identifier(table),
        columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
        placeholders=sql.SQL(", ").join(sql.Placeholder() * len(columns)),
        key=sql.SQL(", ").join(map(sql.Identifier, key)),
        assignments=sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in values
        ),
        version=sql.Identifier(version_column),
    )
    row = tx.execute(statement, [*key.values(), *values.values()]).fetchone()
    if row is None:
        return "stale"
    return "inserted" if row[0] else "updated"


def advisory_guard(tx: psycopg.Connection[Any], namespace: str, name: str) -> bool:
    """Try to take a transaction-scoped advisory lock on (namespace, name); False if someone holds it.

    Safe behind PgBouncer in transaction mode (the lock ends with the transaction). The key is 64 bits
    from SHA-256, so unrelated events practically never contend.
    """
    if tx.autocommit and tx.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("advisory_guard needs an open transaction: the lock would end with this statement")
    row = tx.execute("SELECT pg_try_advisory_xact_lock(%s)", (advisory_key(namespace, name),)).fetchone()
    return bool(row and row[0])


def run_serializable(
    conn: psycopg.Connection[Any],
    work: Callable[[psycopg.Connection[Any]], T],
    *,
    isolation: Literal["serializable", "repeatable read"] = "serializable",
    attempts: int = 5,
) -> T:
    """Run `work(conn)` in its own transaction at `isolation`, retrying serialization failures.

    Each retry re-reads the world, so a claim that lost the race now sees the duplicate and skips it.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError("run_serializable starts its own transaction; the connection has one open")
    level = sql.SQL("SET TRANSACTION ISOLATION LEVEL " + isolation.upper())
    retrying = tenacity.Retrying(
        # The statement lost a race (serialization failure, deadlock, lock timeout: the one shared rule),
        # on a connection that is still usable; a lost connection is the caller's to handle.
        retry=tenacity.retry_if_exception(
            lambda exc: transient_database_error(exc) and not database_unavailable(exc, conn)
        ),
        stop=tenacity.stop_after_attempt(attempts),
        # Full jitter, so transactions that collided once do not collide again in step.
        wait=tenacity.wait_random_exponential(multiplier=0.02, max=1.0),
        reraise=True,  # the last serialization failure itself, not a RetryError
    )

    def once() -> T:
        with conn.transaction():
            conn.execute(level)
            return work(conn)

    return retrying(once)


def prune_inbox(
    conn: psycopg.Connection[Any],
    retention: timedelta = DEFAULT_INBOX_RETENTION,
    batch_size: int = 5000,
    max_batches: int | None = None,
    *,
    include_failed: bool = False,
) -> int:
    """Delete applied inbox rows received before `retention` ago, a batch per transaction; returns rows
    deleted. Parked (failed) rows were never applied, so they stay unless `include_failed`.

    Deleting a key forgets it: a replay older than the retention would be applied again. Keep it longer
    than the provider's redelivery window.
    """
    params = {"retention": retention, "include_failed": include_failed}
    return delete_in_batches(conn, query(QUERIES, "prune_messages"), params, batch_size, max_batches)
