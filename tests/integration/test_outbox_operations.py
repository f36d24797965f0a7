"""enqueue, status, requeue and prune on a real database."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import timedelta

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postbox.relay.outbox import OutboxEvent, PayloadError, enqueue, enqueue_many
from postbox.relay.outbox.admin import prune, requeue, status
from tests.support.database import written_state
from tests.support.modes import BOTH_MODES, QUEUE_ONLY
from tests.support.servers import Servers

Conn = psycopg.Connection[tuple[object, ...]]


def test_enqueue_writes_inside_the_callers_transaction(
    servers: Servers, schema: str, db: Conn, relay_mode: str
) -> None:
    with psycopg.connect(servers.database_url) as app:
        event_id = enqueue(
            app, "order", "o-1", "Placed", {"a": 1}, headers={"h": "v"}, topic="t.x", schema=schema
        )
        assert db.execute("SELECT count(*) FROM outbox").fetchone() == (0,), "not visible before commit"
        app.rollback()
    assert db.execute("SELECT count(*) FROM outbox").fetchone() == (0,), "rolled back with the caller"
    with psycopg.connect(servers.database_url) as app, app.cursor() as cursor:
        event_id = enqueue(
            cursor, "order", "o-1", "Placed", {"a": 1}, headers={"h": "v"}, topic="t.x", schema=schema
        )
        app.commit()
    row = db.execute(
        "SELECT aggregate_type, aggregate_id, event_type, payload, headers, topic, state, shard "
        "FROM outbox WHERE event_id = %s",
        (event_id,),
    ).fetchone()
    assert row is not None
    assert row[:7] == ("order", "o-1", "Placed", {"a": 1}, {"h": "v"}, "t.x", written_state(relay_mode))
    assert 0 <= int(str(row[7])) < 64


def test_enqueue_many_keeps_order_and_bytes(servers: Servers, schema: str, db: Conn) -> None:
    events = [OutboxEvent("doc", "d", "Chunk", b"\x00\x01" * i) for i in range(5)]
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(app, events, schema=schema)
        app.commit()
    rows = db.execute("SELECT event_id, payload, payload_bytes FROM outbox ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ids
    assert [bytes(r[2]) for r in rows] == [e.payload for e in events]
    assert all(r[1] is None for r in rows)


@pytest.mark.parametrize("payload", [{"when": object()}, {"x": float("nan")}])
def test_an_unserialisable_payload_is_refused_before_anything_is_written(
    servers: Servers, schema: str, db: Conn, payload: object
) -> None:
    with psycopg.connect(servers.database_url) as app:
        with pytest.raises(PayloadError, match="not JSON-serialisable"):
            enqueue_many(
                app, [OutboxEvent("a", "1", "Ok", {}), OutboxEvent("a", "1", "Bad", payload)], schema=schema
            )
        app.commit()
    assert db.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def _park(db: Conn, ids: list[object], error: str) -> None:
    db.execute(
        "UPDATE outbox SET state = 'failed', attempts = 1, last_error = %s WHERE event_id = ANY(%s)",
        (error, ids),
    )


@QUEUE_ONLY  # rows marked published by hand, pruned one by one: queue mode's (log mode empties partitions)
def test_status_requeue_and_prune(servers: Servers, schema: str, db: Conn) -> None:
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(
            app, [OutboxEvent("order", f"o{i}", "E", {"i": i}) for i in range(6)], schema=schema
        )
        app.commit()
    _park(db, ids[:2], "Broker: Message size too large")
    _park(db, ids[2:3], "header 'x' is not a string")
    db.execute(
        "UPDATE outbox SET state = 'published', published_at = now() - interval '10 days' "
        "WHERE event_id = ANY(%s)",
        (ids[3:5],),
    )
    st = status(db)
    assert (st.backlog, st.failed, st.unowned_shards) == (1, 3, 64)

    with psycopg.connect(servers.database_url) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        assert len(requeue(conn, error_like="%too large%")) == 2
        assert requeue(conn, ids=[999_999]) == []
    assert status(db).failed == 1

    with psycopg.connect(servers.database_url) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        assert prune(conn, timedelta(days=7), batch_size=1).rows == 2
        assert prune(conn, timedelta(days=7)).rows == 0
    remaining = dict(db.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall())
    assert remaining == {"pending": 3, "failed": 1}, "prune never touches pending or parked rows"


@BOTH_MODES
def test_the_cli_reports_status_and_requeues(
    servers: Servers, schema: str, db: Conn, relay_mode: str
) -> None:
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(app, [OutboxEvent("order", "o", "E", {}) for _ in range(2)], schema=schema)
        app.commit()
    _park(db, ids[:1], "Broker: Message size too large")
    base = [sys.executable, "-m", "postbox", "relay"]
    common = ["--database-url", servers.database_url, "--schema", schema]
    out = subprocess.run([*base, "status", *common], capture_output=True, text=True, check=True).stdout
    assert "backlog            1 rows" in out
    assert "failed             1 rows" in out
    assert "too large" in out
    refused = subprocess.run([*base, "requeue", *common], capture_output=True, text=True, check=False)
    assert refused.returncode == 2
    assert "say which failed rows" in refused.stderr
    done = subprocess.run([*base, "requeue", *common, "--all"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("requeued 1 rows")
    states = {
        str(state): int(str(count))
        for state, count in db.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall()
    }
    # The requeued row is pending in either mode (log mode claims it before its shard's log goes on).
    assert states == ({"pending": 2} if relay_mode == "queue" else {"pending": 1, "logged": 1}), states
    uuid.UUID(str(ids[0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Every category, surrogates included, with NUL and backslash-u0000 look-alikes made likely.
@given(
    text=st.lists(
        st.one_of(st.characters(exclude_categories=()), st.sampled_from(["\x00", "\\u0000", "\\"])),
        max_size=40,
    ).map("".join)
)
def test_whatever_enqueue_accepts_the_database_stores_unchanged(
    servers: Servers, schema: str, text: str
) -> None:
    event = OutboxEvent("fuzz", text or "x", "E", {"text": text, "nested": [text]}, headers={"h": text})
    with psycopg.connect(servers.database_url) as app:
        try:
            [event_id] = enqueue_many(app, [event], schema=schema)
        except PayloadError:
            assert "\x00" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text)
            return
        app.commit()
        stored = app.execute(
            f'SELECT aggregate_id, payload, headers FROM "{schema}".outbox WHERE event_id = %s', (event_id,)
        ).fetchone()
    assert stored == (text or "x", {"text": text, "nested": [text]}, {"h": text})
