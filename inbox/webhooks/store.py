"""Writing events into the webhook inbox: the one insert the receiver and reconciliation share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import psycopg

from postbox.inbox.webhooks.providers import IncomingEvent
from postbox.relay.core.batched import delete_in_batches
from postbox.relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")
INSERT_EVENTS = query(QUERIES, "insert_events")
# Stripe resends manually for up to 30 days after 3 days of retries; Marqeta retries a little over 12 days.
DEFAULT_WEBHOOK_RETENTION = timedelta(days=60)


class WebhookStatus(StrEnum):
    """A webhook event's status, as stored in webhook_inbox.status."""

    PENDING = "pending"  # stored, waiting for a worker (or for its retry time)
    PROCESSING = "processing"  # claimed by a worker; the reaper returns it if that worker dies
    DONE = "done"
    FAILED = "failed"  # parked: out of attempts or a PermanentError, until `requeue-webhooks`


def insert_params(events: Sequence[IncomingEvent]) -> dict[str, list[Any]]:
    return {
        "providers": [e.provider for e in events],
        "ids": [e.event_id for e in events],
        "types": [e.event_type for e in events],
        "payloads": [e.payload_json if e.payload_json is not None else json.dumps(e.payload) for e in events],
        "headers": [json.dumps(e.headers) for e in events],
        "twins": [e.twin_key for e in events],
    }


def store_events(conn: psycopg.Connection[Any], events: Sequence[IncomingEvent]) -> int:
    """Insert (deduplicating) in the caller's transaction; returns how many rows were new."""
    if not events:
        return 0
    return len(conn.execute(INSERT_EVENTS, insert_params(events)).fetchall())


def prune_webhooks(
    conn: psycopg.Connection[Any],
    retention: timedelta = DEFAULT_WEBHOOK_RETENTION,
    batch_size: int = 5000,
    *,
    include_failed: bool = False,
) -> int:
    """Delete done rows received before `retention` ago, a batch per transaction; failed ones (never
    applied) only with `include_failed`; pending and processing rows never."""
    params = {"retention": retention, "include_failed": include_failed}
    return delete_in_batches(conn, query(QUERIES, "prune_events"), params, batch_size)
