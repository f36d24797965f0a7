"""Apply the versioned SQL files in schemas/migrations in order, once each, into a named schema.

Safe when several pods start together: the whole run holds a transaction-scoped advisory lock keyed on the
schema, and all pending migrations apply in that one transaction (PostgreSQL DDL is transactional), so a
crash at any point leaves either every pending migration applied or none.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from relay.core.db import advisory_key

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
MIGRATIONS_TABLE = "postbox_migrations"


class MigrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations_dir() -> Path:
    """The shipped SQL: inside the wheel at relay/schemas, or the repo's top-level schemas/ in a checkout."""
    packaged = Path(str(resources.files("relay"))) / "schemas" / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "schemas" / "migrations"


def parse_migrations(files: dict[str, str]) -> list[Migration]:
    """Migrations from {file name: text}, in version order (pure; rejects gaps, repeats and odd names)."""
    found: list[Migration] = []
    for file_name, text in files.items():
        match = _FILE_NAME.match(file_name)
        if match is None:
            raise MigrationError(f"migration file {file_name!r} is not named NNNN_name.sql")
        found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise MigrationError(
                f"migration versions must run 1, 2, 3...: found {migration.version} "
                f"where {expected} was expected"
            )
    return found


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or migrations_dir()
    return parse_migrations({p.name: p.read_text() for p in directory.glob("*.sql")})


def applied_versions(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> dict[int, str]:
    """{version: checksum} already recorded in the schema, or {} where postbox was never installed."""
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".{MIGRATIONS_TABLE}',)
    ).fetchone()
    if not exists or not exists[0]:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}.{}").format(
            sql.Identifier(schema), sql.Identifier(MIGRATIONS_TABLE)
        )
    ).fetchall()
    return {int(str(v)): str(c) for v, c in rows}


def created_by(applied: list[Migration], migrations: list[Migration] | None = None) -> bool:
    """Whether the run that applied `applied` created the schema's tables: it applied the first migration."""
    first = (load_migrations() if migrations is None else migrations)[0]
    return bool(applied) and applied[0].version == first.version


def migrate(
    conn: psycopg.Connection[tuple[object, ...]],
    schema: str,
    migrations: list[Migration] | None = None,
    *,
    on_create: Callable[[psycopg.Connection[tuple[object, ...]]], object] | None = None,
) -> list[Migration]:
    """Bring `schema` up to date; returns the migrations this call applied (empty when already current).
    `on_create` runs when this call applied the first migration (it created the tables), after the last,
    in the same transaction and with the schema on the search path: a new schema's first settings are
    committed with its tables or not at all, and no other session ever sees it without them."""
    migrations = load_migrations() if migrations is None else migrations
    schema_id = sql.Identifier(schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_key("postbox.migrate", schema),))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema_id))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.{} (version integer PRIMARY KEY, name text NOT NULL, "
                "checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(schema_id, sql.Identifier(MIGRATIONS_TABLE))
        )
        done = applied_versions(conn, schema)
        for migration in migrations:
            recorded = done.get(migration.version)
            if recorded is not None and recorded != migration.checksum:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} was changed after it was applied "
                    f"to schema {schema!r}: write a new migration instead of editing an applied one"
                )
        pending = [m for m in migrations if m.version not in done]
        conn.execute(sql.SQL("SET LOCAL search_path TO {}, public").format(schema_id))
        for migration in pending:
            conn.execute(migration.sql.encode())  # shipped files, never user input
            conn.execute(
                sql.SQL("INSERT INTO {}.{} (version, name, checksum) VALUES (%s, %s, %s)").format(
                    schema_id, sql.Identifier(MIGRATIONS_TABLE)
                ),
                (migration.version, migration.name, migration.checksum),
            )
        if on_create is not None and created_by(pending, migrations):
            on_create(conn)
    return pending
