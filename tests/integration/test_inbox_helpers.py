"""The article's helpers on real PostgreSQL: 18 from the wheel and the system's 15 (xmax = 0 is an
implementation detail, so it is checked on both ends of the supported range)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors

from postbox.inbox.helpers import advisory_guard, prune_inbox, run_serializable, upsert_snapshot
from postbox.relay.core.migrate import migrate
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="module", params=["embedded", "system"])
def server(request: pytest.FixtureRequest) -> Iterator[LocalPostgres]:
    postgres = LocalPostgres(find_bin_dir(request.param)).start()
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
        conn.execute(
            "CREATE TABLE orders (order_id text PRIMARY KEY, status text NOT NULL, "
            "source_updated_at timestamptz NOT NULL)"
        )
    yield postgres
    postgres.stop()


def test_the_server_versions_under_test(server: LocalPostgres) -> None:
    assert int(server.server_version().split(".")[0]) >= 15


def test_snapshot_upsert_refuses_stale_versions_and_tells_insert_from_update(server: LocalPostgres) -> None:
    with psycopg.connect(server.dsn) as tx:

        def put(status: str, at: str) -> str:
            return upsert_snapshot(
                tx,
                "public.orders",
                {"order_id": "ord_555"},
                {"status": status, "source_updated_at": at},
                "source_updated_at",
            )

        assert put("delivered", "2026-09-20T12:00:05Z") == "inserted"
        assert put("shipped", "2026-09-20T12:00:00Z") == "stale", "an older snapshot arriving late"
        assert put("delivered", "2026-09-20T12:00:05Z") == "stale", "an identical replay is a no-op"
        assert put("returned", "2026-09-20T13:00:00Z") == "updated"
        assert tx.execute("SELECT status FROM orders WHERE order_id = 'ord_555'").fetchone() == ("returned",)
        tx.rollback()


def test_advisory_guard_lets_one_transaction_in_and_the_other_bail(server: LocalPostgres) -> None:
    with psycopg.connect(server.dsn) as first, psycopg.connect(server.dsn) as second:
        assert advisory_guard(first, "stripe", "evt_1") is True
        assert advisory_guard(second, "stripe", "evt_1") is False, "busy: someone is on this event"
        assert advisory_guard(second, "stripe", "evt_2") is True, "a different event is free"
        first.commit()
        second.rollback()
        assert advisory_guard(second, "stripe", "evt_1") is True, "released with the transaction"
        second.rollback()
    with (
        psycopg.connect(server.dsn, autocommit=True) as conn,
        pytest.raises(ValueError, match="open transaction"),
    ):
        advisory_guard(conn, "stripe", "evt_1")


def test_run_serializable_retries_a_serialization_failure(server: LocalPostgres) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS counters (id int PRIMARY KEY, n int NOT NULL)")
        setup.execute("INSERT INTO counters VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET n = 0")
    calls = 0

    def work(tx: Conn) -> int:
        nonlocal calls
        calls += 1
        tx.execute("SELECT n FROM counters WHERE id = 1").fetchone()  # takes the snapshot
        if calls == 1:  # a concurrent writer commits after our snapshot: our update must fail with 40001

            def other() -> None:
                with psycopg.connect(server.dsn, autocommit=True) as conn:
                    conn.execute("UPDATE counters SET n = n + 100 WHERE id = 1")

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        row = tx.execute("UPDATE counters SET n = n + 1 WHERE id = 1 RETURNING n").fetchone()
        assert row is not None
        return int(row[0])

    with psycopg.connect(server.dsn) as conn:
        assert run_serializable(conn, work, isolation="repeatable read") == 101
    assert calls == 2, "the first attempt failed with 40001 and was retried on a fresh snapshot"

    def always_conflicts(tx: Conn) -> None:
        raise errors.SerializationFailure("simulated")

    with psycopg.connect(server.dsn) as conn, pytest.raises(errors.SerializationFailure):
        run_serializable(conn, always_conflicts, attempts=2)


def test_prune_inbox_keeps_recent_rows(server: LocalPostgres) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SET search_path TO postbox")
        conn.execute("DELETE FROM inbox_message")
        conn.execute(
            "INSERT INTO inbox_message (consumer, message_id, topic, kafka_partition, kafka_offset, "
            "received_at) SELECT 'c', 'm' || i, 't', 0, i, now() - (i || ' days')::interval "
            "FROM generate_series(1, 100) AS i"
        )
    with psycopg.connect(server.dsn) as conn:
        conn.execute("SET search_path TO postbox")
        conn.commit()
        assert prune_inbox(conn, timedelta(days=60), batch_size=7) == 41
        remaining = conn.execute("SELECT count(*), max(kafka_offset) FROM inbox_message").fetchone()
    assert remaining == (59, 59)
