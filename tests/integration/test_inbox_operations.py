"""`postbox inbox status`, `status-webhooks` and `requeue-webhooks` on a real database, and a requeued
webhook event processed again by a real worker."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg

from tests.apps.hooks import SCHEMA_SQL as HOOKS_SQL
from tests.support.processes import WorkerProcess, inbox_cli
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]


def test_inbox_status_counts_per_consumer_and_lists_the_parked(
    servers: Servers, schema: str, db: Conn
) -> None:
    assert "no inbox messages" in inbox_cli(servers, schema, "status").stdout
    db.execute(
        "INSERT INTO inbox_message (consumer, message_id, topic, kafka_partition, kafka_offset, status, "
        "error, processed_at) VALUES "
        "('billing', 'm1', 't', 0, 1, 'done', NULL, now()), "
        "('billing', 'm2', 't', 0, 2, 'done', NULL, now()), "
        "('billing', 'm3', 't', 1, 7, 'failed', 'KeyError: total', NULL), "
        "('shipping', 'm1', 't', 0, 1, 'done', NULL, now())"
    )
    out = inbox_cli(servers, schema, "status").stdout
    assert "billing: done 2, failed 1" in out
    assert "shipping: done 1, failed 0" in out
    assert "failed billing m3 at t/1/7 attempts=1: KeyError: total" in out
    only = inbox_cli(servers, schema, "status", "--consumer", "shipping").stdout
    assert "billing" not in only


def test_failed_webhook_events_are_requeued_with_fresh_attempts_and_processed_again(
    servers: Servers, schema: str, db: Conn
) -> None:
    db.execute(HOOKS_SQL)
    db.execute(
        "INSERT INTO webhook_inbox (provider, event_id, event_type, payload, status, attempts, last_error) "
        "VALUES "
        "('stripe', 'evt_1', 'invoice.paid', '{}', 'failed', 3, 'RuntimeError: db of the day'), "
        "('shopify', 'wh_1', 'orders/create', '{}', 'failed', 3, 'RuntimeError: other'), "
        "('stripe', 'evt_2', 'invoice.paid', '{}', 'done', 1, NULL)"
    )
    out = inbox_cli(servers, schema, "status-webhooks").stdout
    assert "stripe       failed            1 events" in out
    assert "failed stripe evt_1 invoice.paid attempts=3: RuntimeError: db of the day" in out
    refused = inbox_cli(servers, schema, "requeue-webhooks", check=False)
    assert refused.returncode == 2
    assert "say which failed events" in refused.stderr
    out = inbox_cli(
        servers, schema, "requeue-webhooks", "--provider", "stripe", "--error-like", "%db of%"
    ).stdout
    assert "requeued 1 webhook events: stripe/evt_1" in out
    row = db.execute("SELECT status, attempts FROM webhook_inbox WHERE event_id = 'evt_1'").fetchone()
    assert row == ("pending", 0)
    assert db.execute("SELECT status FROM webhook_inbox WHERE event_id = 'wh_1'").fetchone() == ("failed",)
    with WorkerProcess(servers.database_url, schema) as worker:
        wait_until(
            lambda: (
                db.execute("SELECT status FROM webhook_inbox WHERE event_id = 'evt_1'").fetchone()
                == ("done",)
            ),
            30,
            what="the requeued event processed",
        )
        assert worker.terminate() == 0
    assert db.execute("SELECT event_id FROM applied").fetchall() == [("evt_1",)]


def test_parked_kafka_messages_are_read_again_and_applied_by_a_later_release(
    servers: Servers, schema: str, bank: Conn
) -> None:
    from tests.support.kafka import create_topic, produce_with_headers  # noqa: PLC0415
    from tests.support.processes import InboxProcess  # noqa: PLC0415

    db = bank
    topic = f"requeue-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    records = [
        [("id", b"d1"), ("eventType", b"Deposit")],
        [("id", b"n1"), ("eventType", b"Nope")],  # no handler in this release: parked
        [("id", b"bad\x00id"), ("eventType", b"Nope")],  # unusable id: parked under its coordinates
        [("id", b"d2"), ("eventType", b"Deposit")],
    ]
    produce_with_headers(servers.kafka_bootstrap, topic, b'{"account": "acc", "amount": 1}', b"acc", records)
    hook_log = Path(f"/tmp/postbox-test-hooks-{uuid.uuid4().hex[:8]}")
    hooks = {"BANK_HOOK_LOG": str(hook_log)}  # the after_commit hooks write what they were called for
    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, "tests.apps.bank:inbox", [topic], env=hooks
    ) as inbox:
        wait_until(
            lambda: db.execute("SELECT count(*) FROM inbox_message").fetchone() == (4,),
            60,
            what="all recorded",
        )
        assert inbox.terminate() == 0
    parked = dict(
        db.execute("SELECT message_id, error FROM inbox_message WHERE status = 'failed'").fetchall()
    )
    assert set(parked) == {"n1", f"{topic}/0/2"}
    assert sorted(hook_log.read_text().split()) == ["d1", "d2"], "hooks run for the applied messages only"

    base = ["requeue", "--app", "tests.apps.bank_later:inbox", "--kafka-bootstrap", servers.kafka_bootstrap]
    refused = inbox_cli(servers, schema, *base, check=False)
    assert refused.returncode == 2
    out = inbox_cli(servers, schema, *base, "--all", env=hooks).stdout
    assert "requeued 2 failed messages of bank: 1 applied, 1 failed again, 0 no longer on the broker" in out
    assert f"failed again {topic}/0/2: its id is unusable" in out
    assert db.execute("SELECT status FROM inbox_message WHERE message_id = 'n1'").fetchone() == ("done",)
    assert db.execute("SELECT message_id FROM effects WHERE account = 'nope'").fetchall() == [("n1",)]
    assert sorted(hook_log.read_text().split()) == ["d1", "d2", "n1"], "and for the ones requeue applies"
    again = inbox_cli(servers, schema, *base, "--all").stdout
    assert "0 applied, 1 failed again" in again, "an applied message is not run twice"
    assert db.execute("SELECT count(*) FROM effects WHERE account = 'nope'").fetchone() == (1,)


def _terminate(db: Conn, application_name: str) -> int:
    """End every session of that application_name (what an operator or a failover does); how many."""
    ended = db.execute(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name = %s AND pid <> pg_backend_pid()",
        (application_name,),
    ).fetchone()
    assert ended is not None
    return int(str(ended[0]))


def test_the_inbox_consumer_reconnects_after_its_session_is_terminated(
    servers: Servers, schema: str, bank: Conn
) -> None:
    from tests.support.kafka import create_topic, produce  # noqa: PLC0415
    from tests.support.processes import InboxProcess  # noqa: PLC0415

    db = bank
    topic = f"term-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)

    def balance() -> object:
        return db.execute("SELECT balance FROM accounts WHERE id = 'acc'").fetchone()

    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, "tests.apps.bank:inbox", [topic]
    ) as inbox:
        produce(servers.kafka_bootstrap, topic, [("t1", "Deposit", {"account": "acc", "amount": 1})])
        wait_until(lambda: balance() == (1,), 60, what="the first deposit")
        assert _terminate(db, "postbox-inbox bank") >= 1
        produce(servers.kafka_bootstrap, topic, [("t2", "Deposit", {"account": "acc", "amount": 1})])
        wait_until(lambda: balance() == (2,), 60, what="the deposit after the session was ended")
        assert inbox.process.poll() is None
        assert "inbox_database_unavailable" in inbox.log()
        assert inbox.terminate() == 0


def test_the_webhook_worker_reconnects_after_its_session_is_terminated(
    servers: Servers, schema: str, db: Conn
) -> None:
    db.execute(HOOKS_SQL)

    def insert(event_id: str) -> None:
        db.execute(
            "INSERT INTO webhook_inbox (provider, event_id, event_type, payload) "
            "VALUES ('stripe', %s, 'invoice.paid', '{}')",
            (event_id,),
        )

    def applied() -> list[tuple[object, ...]]:
        return db.execute("SELECT event_id FROM applied ORDER BY event_id").fetchall()

    with WorkerProcess(servers.database_url, schema) as worker:
        insert("evt_a")
        wait_until(lambda: applied() == [("evt_a",)], 30, what="the first event")
        assert _terminate(db, "postbox-webhooks") >= 1
        insert("evt_b")
        wait_until(
            lambda: applied() == [("evt_a",), ("evt_b",)], 60, what="the event after the session ended"
        )
        assert worker.process.poll() is None
        assert "webhook_worker_database_unavailable" in worker.log()
        assert worker.terminate() == 0


def test_the_inbox_consumer_and_webhook_worker_carry_on_after_a_database_restart(
    servers: Servers, own_postgres: Any
) -> None:
    from postbox.relay.core.migrate import migrate  # noqa: PLC0415
    from tests.apps.bank import SCHEMA_SQL as BANK_SQL  # noqa: PLC0415
    from tests.support.database import execute_script  # noqa: PLC0415
    from tests.support.kafka import create_topic, produce  # noqa: PLC0415
    from tests.support.processes import InboxProcess  # noqa: PLC0415

    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
        execute_script(conn, f"{BANK_SQL};{HOOKS_SQL}")
    topic = f"restart-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)

    def one(sql: str) -> object:
        with psycopg.connect(own_postgres.dsn) as conn:
            return conn.execute(sql).fetchone()

    with (
        InboxProcess(
            own_postgres.dsn, servers.kafka_bootstrap, "postbox", "tests.apps.bank:inbox", [topic]
        ) as inbox,
        WorkerProcess(own_postgres.dsn, "postbox") as worker,
    ):
        produce(servers.kafka_bootstrap, topic, [("r1", "Deposit", {"account": "acc", "amount": 1})])
        wait_until(lambda: one("SELECT balance FROM accounts") == (1,), 60, what="a deposit before")
        own_postgres.crash()
        produce(servers.kafka_bootstrap, topic, [("r2", "Deposit", {"account": "acc", "amount": 1})])
        wait_until(
            lambda: (
                "inbox_database_unavailable" in inbox.log()
                and "webhook_worker_database_unavailable" in worker.log()
            ),
            30,
            what="both noticing the database is gone",
        )
        own_postgres.start_again()
        with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO postbox.webhook_inbox (provider, event_id, event_type, payload) "
                "VALUES ('stripe', 'evt_after', 'invoice.paid', '{}')"
            )
        wait_until(lambda: one("SELECT balance FROM accounts") == (2,), 60, what="the deposit made meanwhile")
        wait_until(
            lambda: one("SELECT count(*) FROM applied") == (1,), 60, what="the webhook after the restart"
        )
        assert inbox.process.poll() is None
        assert worker.process.poll() is None
        assert inbox.terminate() == 0
        assert worker.terminate() == 0


def test_the_scheduled_reconciler_carries_on_after_a_database_restart(own_postgres: Any) -> None:
    """`reconcile --every` runs on the daemon skeleton: a pass that finds the database gone is logged and
    retried after a backoff, the process stays up, and the passes after the restart store events again."""
    from postbox.relay.core.migrate import migrate  # noqa: PLC0415
    from tests.support.processes import ChildProcess  # noqa: PLC0415

    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")

    def stored() -> int:
        with psycopg.connect(own_postgres.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM postbox.webhook_inbox").fetchone()
        assert row is not None
        return int(row[0])

    args = ["inbox", "reconcile", "--app", "tests.apps.hooks:TickingReconciler", "--every", "1s"]
    args += ["--database-url", own_postgres.dsn, "--schema", "postbox"]
    with ChildProcess(f"reconciler-{uuid.uuid4().hex[:6]}", args) as reconciler:
        wait_until(lambda: stored() >= 1, 30, what="a first reconciled event")
        own_postgres.crash()
        wait_until(
            lambda: "reconciler_database_unavailable" in reconciler.log(),
            30,
            what="the reconciler noticing the database is gone",
        )
        assert reconciler.process.poll() is None
        own_postgres.start_again()
        before = stored()
        wait_until(lambda: stored() > before, 60, what="a pass after the restart")
        assert reconciler.process.poll() is None
        assert reconciler.terminate() == 0
