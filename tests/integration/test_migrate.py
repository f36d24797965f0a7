"""postbox migrate on a real database: idempotent, safe when pods race, refuses edited history."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import psycopg
import pytest

from postbox.relay.core.migrate import Migration, MigrationError, load_migrations, migrate
from postbox.relay.outbox import enqueue
from postbox.relay.outbox.admin import migrate_schema
from postbox.relay.outbox.daemon import NOTIFY_CHANNEL
from tests.support.database import outbox_states
from tests.support.kafka import read_topic
from tests.support.processes import RelayProcess, followed_modes
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until


def test_migrate_twice_applies_once(servers: Servers) -> None:
    schema = f"m_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        assert [m.version for m in migrate(conn, schema)] == [m.version for m in load_migrations()]
        assert migrate(conn, schema) == []
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
            ).fetchall()
        }
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert {"outbox", "outbox_shard_lease", "outbox_relay_member", "postbox_migrations"} <= tables


def test_pods_migrating_at_once_do_not_race(servers: Servers) -> None:
    schema = f"m_{uuid.uuid4().hex[:8]}"
    results: list[object] = []

    def pod() -> None:
        try:
            with psycopg.connect(servers.database_url, autocommit=True) as conn:
                results.append(len(migrate_schema(conn, schema, "log")))  # as `postbox migrate` does
        except Exception as exc:  # noqa: BLE001  (any failure is collected and asserted on below)
            results.append(exc)

    pods = [threading.Thread(target=pod) for _ in range(6)]
    for thread in pods:
        thread.start()
    for thread in pods:
        thread.join(timeout=60)
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        recorded = conn.execute(f'SELECT count(*) FROM "{schema}".postbox_migrations').fetchone()
        switches = conn.execute(f'SELECT mode, tick FROM "{schema}".outbox_mode').fetchall()
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert sorted(results, key=str) == sorted([0] * 5 + [len(load_migrations())], key=str)
    assert recorded == (len(load_migrations()),)
    assert [mode for mode, _ in switches] == ["log"], "the pod that created the outbox switched it, once"


def test_postbox_migrate_starts_a_new_outbox_in_log_mode_and_leaves_an_existing_ones_mode(
    servers: Servers,
) -> None:
    """The new outbox is switched in the transaction that creates it, so a relay left in --mode auto (the
    default) reads it as a log from its first row; --new-outbox-mode queue keeps queue mode, and an outbox
    that exists (in queue mode, from before log mode) is never switched by an upgrade."""
    new, opted_out, existing = (f"m_{uuid.uuid4().hex[:8]}" for _ in range(3))
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        migrate(conn, existing)

    def postbox_migrate(schema: str, *flags: str) -> str:
        command = [sys.executable, "-m", "postbox", "migrate", "--database-url", servers.database_url]
        done = subprocess.run(
            [*command, "--schema", schema, *flags], capture_output=True, text=True, cwd=REPO, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def modes(schema: str) -> list[object]:
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            return [r[0] for r in conn.execute(f'SELECT mode FROM "{schema}".outbox_mode').fetchall()]

    try:
        assert "the new outbox is in log mode" in postbox_migrate(new)
        assert "the new outbox is in queue mode" in postbox_migrate(opted_out, "--new-outbox-mode", "queue")
        assert "already up to date" in postbox_migrate(existing)
        assert (modes(new), modes(opted_out), modes(existing)) == (["log"], [], [])
        aggregate_type = f"fresh{uuid.uuid4().hex[:6]}"
        with psycopg.connect(servers.database_url) as app:
            event_id = enqueue(app, aggregate_type, "a", "Created", {"n": 1}, schema=new)
            app.commit()
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, new) as relay:
            records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=1)
            assert relay.terminate() == 0
        assert followed_modes(relay) == ["log"]
        assert [r.headers["id"].decode() for r in records] == [str(event_id)]
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            states = conn.execute(f'SELECT state FROM "{new}".outbox').fetchall()
        assert states == [("logged",)], "read as a log: nothing written back"
    finally:
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            for schema in (new, opted_out, existing):
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_an_edited_applied_migration_is_refused_and_nothing_changes(servers: Servers) -> None:
    schema = f"m_{uuid.uuid4().hex[:8]}"
    shipped = load_migrations()
    edited = [Migration(shipped[0].version, shipped[0].name, shipped[0].sql + "\n-- edited"), *shipped[1:]]
    extra = Migration(len(shipped) + 1, "later", "CREATE TABLE should_not_exist (id int);")
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        migrate(conn, schema)
        with pytest.raises(MigrationError, match="was changed after it was applied"):
            migrate(conn, schema, [*edited, extra])
        exists = conn.execute("SELECT to_regclass(%s)", (f"{schema}.should_not_exist",)).fetchone()
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert exists == (None,)


def test_the_plain_sql_applies_with_another_tool(servers: Servers) -> None:
    """A team's own tool: SET search_path, then run each file as it is."""
    schema = f"m_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        with conn.transaction():
            conn.execute(f'SET LOCAL search_path TO "{schema}"')
            for migration in load_migrations():
                conn.execute(migration.sql.encode())
        count = conn.execute(f'SELECT count(*) FROM "{schema}".outbox_shard_lease').fetchone()
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert count == (64,)


def test_partitioning_an_existing_outbox_keeps_its_rows_ids_grants_and_wake_ups(servers: Servers) -> None:
    """Migration 0007 turns a live outbox into the first partition of a partitioned one: every row stays as
    it was, ids go on, a writer's column grants still hold (and still refuse the relay's columns), inserts
    still wake the relay, and a relay publishes what was pending."""
    schema = f"m_{uuid.uuid4().hex[:8]}"
    writer = f"w_{uuid.uuid4().hex[:8]}"
    before = [m for m in load_migrations() if m.version < 7]
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        try:
            migrate(conn, schema, before)
            conn.execute(f'SET search_path TO "{schema}"')
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'upgrade', 'a' || i, 'E', jsonb_build_object('i', i) FROM generate_series(1, 6) AS i"
            )
            conn.execute("UPDATE outbox SET state = 'published', published_at = now() WHERE id <= 2")
            conn.execute("UPDATE outbox SET state = 'failed', last_error = 'parked' WHERE id = 3")
            conn.execute(f"CREATE ROLE {writer}")
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {writer}')
            conn.execute(
                f"GRANT INSERT (aggregate_type, aggregate_id, event_type, payload) ON outbox TO {writer}"
            )
            rows = conn.execute("SELECT id, event_id, state, txid FROM outbox ORDER BY id").fetchall()

            assert [m.version for m in migrate(conn, schema)] == [
                m.version for m in load_migrations() if m.version >= 7
            ]
            assert conn.execute("SELECT relkind FROM pg_class WHERE oid = 'outbox'::regclass").fetchone() == (
                "p",
            )
            assert (
                conn.execute("SELECT id, event_id, state, txid FROM outbox_p0 ORDER BY id").fetchall() == rows
            )

            with psycopg.connect(servers.database_url, autocommit=True) as listener:
                listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
                conn.execute(f"SET ROLE {writer}")
                conn.execute(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                    "VALUES ('upgrade', 'b', 'E', '{}')"
                )
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, state) "
                        "VALUES ('upgrade', 'c', 'E', 'published')"
                    )
                conn.execute("RESET ROLE")
                woken = list(listener.notifies(timeout=5, stop_after=1))
            new = conn.execute("SELECT id FROM outbox WHERE aggregate_id = 'b'").fetchone()
            assert new == (7,), "ids go on from the old table's"
            assert [n.channel for n in woken] == [NOTIFY_CHANNEL]

            with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
                wait_until(
                    lambda: outbox_states(servers.database_url, schema) == {"published": 6, "failed": 1},
                    30,
                    what="the pending rows published after the upgrade",
                )
                assert relay.terminate() == 0
            partitions = conn.execute("SELECT count(*) FROM outbox_partition WHERE xid_from IS NOT NULL")
            assert partitions.fetchone() == (2,), "the relay created the partitions ahead (two widths)"
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f"DROP ROLE IF EXISTS {writer}")
