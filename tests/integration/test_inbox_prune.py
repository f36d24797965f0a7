"""Retention never deletes what was never applied: `postbox inbox prune` and `prune-webhooks` keep parked
(failed) rows unless asked for them by a flag of their own."""

from __future__ import annotations

import subprocess
import sys

import psycopg

from tests.support.repo import REPO
from tests.support.servers import Servers

Conn = psycopg.Connection[tuple[object, ...]]


def _postbox(servers: Servers, schema: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "postbox", "inbox", *args, "--database-url", servers.database_url,
         "--schema", schema, "--older-than", "60s"],
        check=True, capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    return done.stdout


def test_prune_keeps_parked_messages_and_failed_webhooks_unless_asked(
    servers: Servers, schema: str, db: Conn
) -> None:
    db.execute(
        "INSERT INTO inbox_message (consumer, message_id, topic, kafka_partition, kafka_offset, status, "
        "error, received_at) SELECT 'c', 'm' || i, 't', 0, i, "
        "CASE WHEN i <= 4 THEN 'failed' ELSE 'done' END, CASE WHEN i <= 4 THEN 'boom' END, "
        "now() - interval '1 hour' FROM generate_series(1, 10) AS i"
    )
    db.execute(
        "INSERT INTO webhook_inbox (provider, event_id, event_type, payload, status, received_at) "
        "SELECT 'stripe', 'evt_' || i, 't', '{}', CASE WHEN i <= 3 THEN 'failed' ELSE 'done' END, "
        "now() - interval '1 hour' FROM generate_series(1, 8) AS i"
    )

    def left(table: str) -> dict[str, int]:
        return dict(db.execute(f"SELECT status, count(*) FROM {table} GROUP BY status").fetchall())

    assert "pruned 6 inbox rows" in _postbox(servers, schema, "prune")
    assert left("inbox_message") == {"failed": 4}, "the parked messages, never applied, stay"
    assert "pruned 5 webhook rows" in _postbox(servers, schema, "prune-webhooks")
    assert left("webhook_inbox") == {"failed": 3}
    assert "pruned 4 inbox rows" in _postbox(servers, schema, "prune", "--include-failed")
    assert "pruned 3 webhook rows" in _postbox(servers, schema, "prune-webhooks", "--include-failed")
    assert left("inbox_message") == left("webhook_inbox") == {}
