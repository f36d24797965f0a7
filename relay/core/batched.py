"""Deleting in small batches, one transaction each, so retention never holds long locks or bloats WAL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, LiteralString

import psycopg


def delete_in_batches(
    conn: psycopg.Connection[Any],
    statement: LiteralString,
    params: Mapping[str, object],
    batch_size: int,
    max_batches: int | None = None,
) -> int:
    """Run `statement` (a DELETE of at most %(limit)s rows) until it deletes fewer than `batch_size`;
    returns the rows deleted."""
    deleted = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            count = conn.execute(statement, {**params, "limit": batch_size}).rowcount
        deleted, batches = deleted + count, batches + 1
        if count < batch_size:
            break
    return deleted
