"""One live relay per relay id: a session advisory lock on the lease connection, held while connected.

Leases are owned by relay id, so two live replicas with one id would both believe they own its shards.
A session left by a replica that died without closing its connection (its lease lapsed) is ended."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import structlog
import tenacity

from postbox.relay.core.db import advisory_key
from postbox.relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.relay")


class RelayIdInUse(RuntimeError):
    """Another live replica is connected with this relay id; this one waits until it is gone."""


def lock_relay_id(
    conn: psycopg.Connection[tuple[Any, ...]], schema: str, relay_id: str, lease_ttl: float
) -> None:
    """Hold the relay id's session lock on `conn` (the lease connection, autocommit), or raise
    RelayIdInUse."""
    key = advisory_key("postbox.relay-id", f"{schema}:{relay_id}")

    def lock() -> bool:
        locked = conn.execute(query(QUERIES, "lock_relay_id"), {"key": key}).fetchone()
        return bool(locked and locked[0])

    if lock():
        return
    ended = conn.execute(
        query(QUERIES, "end_stale_relay_id_holder"),
        {
            "high": (key >> 32) & 0xFFFFFFFF,
            "low": key & 0xFFFFFFFF,
            "relay_id": relay_id,
            "ttl": timedelta(seconds=lease_ttl),
        },
    ).fetchone()
    if ended and ended[0]:
        log.warning("relay_stale_session_ended", relay_id=relay_id)
        # A terminated backend releases its locks as it exits: look again for up to about 2 s.
        again = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda locked: not locked),
            stop=tenacity.stop_after_attempt(9),
            wait=tenacity.wait_fixed(0.2),
            retry_error_callback=lambda _state: False,
        )
        if again(lock):
            return
    raise RelayIdInUse(
        f"another relay is connected with relay-id {relay_id!r}; give each replica "
        "its own (the default, hostname-pid, is unique). Waiting for it to go away."
    )
