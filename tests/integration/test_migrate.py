"""postbox migrate on a real database: idempotent, safe when pods race, refuses edited history."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

from relay.core.migrate import Migration, MigrationError, load_migrations, migrate
from tests.servers import Servers


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
                results.append(len(migrate(conn, schema)))
        except Exception as exc:  # noqa: BLE001  (any failure is collected and asserted on below)
            results.append(exc)

    pods = [threading.Thread(target=pod) for _ in range(6)]
    for thread in pods:
        thread.start()
    for thread in pods:
        thread.join(timeout=60)
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        recorded = conn.execute(f'SELECT count(*) FROM "{schema}".postbox_migrations').fetchone()
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert sorted(results, key=str) == sorted([0] * 5 + [len(load_migrations())], key=str)
    assert recorded == (len(load_migrations()),)


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
