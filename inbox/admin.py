"""Operator views of the inboxes: each consumer's messages done and failed, the webhook inbox by status,
and failed webhook events back for another try. Shared by the CLI; no daemon state."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from postbox.relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")
WEBHOOK_QUERIES = Path(__file__).parent / "webhooks" / "queries.sql"
Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class ConsumerStatus:
    consumer: str
    done: int
    failed: int
    oldest_failed_seconds: float
    last_processed: datetime | None


def consumer_status(conn: Connection, consumer: str | None = None) -> list[ConsumerStatus]:
    rows = conn.execute(query(QUERIES, "consumer_status"), {"consumer": consumer}).fetchall()
    return [ConsumerStatus(str(c), int(d), int(f), float(o), last) for c, d, f, o, last in rows]


def failed_messages(conn: Connection, consumer: str | None, limit: int) -> list[tuple[Any, ...]]:
    """(consumer, message id, topic, partition, offset, attempts, reason), oldest first."""
    return conn.execute(query(QUERIES, "failed_messages"), {"consumer": consumer, "limit": limit}).fetchall()


def webhook_status(conn: Connection) -> list[tuple[str, str, int, float]]:
    """(provider, status, events, age of the oldest in seconds)."""
    rows = conn.execute(query(WEBHOOK_QUERIES, "status_by_provider")).fetchall()
    return [(str(p), str(s), int(n), float(a)) for p, s, n, a in rows]


def failed_webhooks(conn: Connection, limit: int) -> list[tuple[Any, ...]]:
    return conn.execute(query(WEBHOOK_QUERIES, "failed_events"), {"limit": limit}).fetchall()


def requeue_webhooks(
    conn: Connection,
    *,
    provider: str | None = None,
    event_ids: list[str] | None = None,
    event_type: str | None = None,
    error_like: str | None = None,
) -> list[tuple[str, str]]:
    """Failed webhook events back to pending (every filter given must match); (provider, id) of each."""
    with conn.transaction():
        rows = conn.execute(
            query(WEBHOOK_QUERIES, "requeue_events"),
            {
                "provider": provider,
                "event_ids": event_ids,
                "event_type": event_type,
                "error_like": error_like,
            },
        ).fetchall()
    return sorted((str(p), str(e)) for p, e in rows)
