"""A downstream service that keeps a copy of a captured table: it applies postbox's change events (the
capture's Debezium format) with the inbox's version-guarded upsert. The captured table's `version` column
grows with each change of a row, so a stale event (older than the copy) changes nothing."""

from __future__ import annotations

from typing import Any

from postbox.inbox import Inbox, Message
from postbox.inbox.helpers import upsert_snapshot

inbox = Inbox("projection", max_attempts=3, retry_backoff=0.01)
APP = "tests.apps.projection:inbox"

SCHEMA_SQL = "CREATE TABLE replica (id integer PRIMARY KEY, name text, version integer NOT NULL)"


def _upsert(tx: Any, message: Message) -> None:
    row = message.payload["after"]
    upsert_snapshot(
        tx, "replica", {"id": row["id"]}, {"name": row["name"], "version": row["version"]}, "version"
    )


for _op in ("c", "u", "r"):  # create, update, snapshot read
    inbox.handler(_op)(_upsert)


@inbox.handler("d")
def delete(tx: Any, message: Message) -> None:
    row = message.payload["before"]
    tx.execute("DELETE FROM replica WHERE id = %s AND version <= %s", (row["id"], row["version"]))


@inbox.handler("tombstone")
def tombstone(tx: Any, message: Message) -> None:
    """For log compaction; the delete before it did the work."""
