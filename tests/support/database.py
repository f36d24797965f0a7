"""The test's schema in PostgreSQL: prepare_outbox (migrate it, in queue or log mode), outbox_states (rows
per state, in either mode), written_state (the state a mode's rows are written in), newest_tick (log
mode's progress), shard_owners (who holds the shard leases) and execute_script (a test app's SCHEMA_SQL)."""

from __future__ import annotations

from typing import Any


def prepare_outbox(database_url: str, schema: str, mode: str = "queue") -> None:
    """Migrate `schema` and, for mode "log", switch its outbox to log mode."""
    import psycopg  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.migrate import migrate  # noqa: PLC0415
    from postbox.relay.outbox.admin import switch_mode  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate(conn, schema)
    if mode == "log":
        with connect(database_url, schema) as conn:
            switch_mode(conn, schema, "log")


def outbox_states(database_url: str, schema: str) -> dict[str, int]:
    """Rows per state, in either mode: a logged row (log mode) counts as published once its shard's cursor
    has passed it (visible in the snapshot of the cursor's tick, or at or below last_id in the window the
    cursor is reading), as pending before."""
    import psycopg  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            f"""
            SELECT CASE WHEN o.state <> 'logged' THEN o.state
                        WHEN pg_visible_in_snapshot(o.txid, t.snapshot) THEN 'published'
                        WHEN o.id <= c.last_id AND pg_visible_in_snapshot(o.txid, w.snapshot) THEN 'published'
                        ELSE 'pending' END,
                   count(*)
            FROM "{schema}".outbox AS o
            LEFT JOIN "{schema}".outbox_cursor AS c ON c.shard = o.shard
            LEFT JOIN "{schema}".outbox_tick AS t ON t.tick = c.tick
            LEFT JOIN "{schema}".outbox_tick AS w ON w.tick = c.window_to
            GROUP BY 1"""
        ).fetchall()
    return {str(state): int(count) for state, count in rows}


def written_state(mode: str) -> str:
    """The state rows are written in, in an outbox of `mode` (migration 0009's insert guard): 'logged' in
    log mode, 'pending' in queue mode. A relay in log mode leaves it so once the row is published."""
    return "logged" if mode == "log" else "pending"


def newest_tick(database_url: str, schema: str) -> int:
    """The newest tick (log mode's snapshot) the relays have taken, 0 before the first. An idle relay in
    log mode takes one at each poll, so this moving on shows it reading on."""
    import psycopg  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(f'SELECT coalesce(max(tick), 0) FROM "{schema}".outbox_tick').fetchone()
    assert found is not None
    return int(found[0])


def shard_owners(database_url: str, schema: str) -> dict[str, int]:
    """Shards per relay id, counting the leases that have not expired."""
    import psycopg  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT owner, count(*) FROM "{schema}".outbox_shard_lease '
            "WHERE owner IS NOT NULL AND expires_at > now() GROUP BY owner"
        ).fetchall()
    return {str(owner): int(count) for owner, count in rows}


def execute_script(conn: Any, script: str) -> None:
    """Run each `;`-separated statement of `script` (the test apps' SCHEMA_SQL) on `conn`."""
    for statement in filter(str.strip, script.split(";")):
        conn.execute(statement)
