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

from postbox.relay.core.db import advisory_key
from postbox.relay.core.operator_errors import SchemaState
from postbox.relay.core.sql import check_schema_name

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
    """The shipped SQL: in the wheel at postbox/relay/schemas; in a checkout, the top-level schemas/."""
    packaged = Path(str(resources.files("postbox.relay"))) / "schemas" / "migrations"
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
    # Quoted by the server: a name with a double quote in it (a"b), spelled '"a"b"' here, was no name to
    # to_regclass (NULL), so a second run found nothing applied and ran every migration again.
    exists = conn.execute(
        "SELECT to_regclass(quote_ident(%s) || '.' || quote_ident(%s)) IS NOT NULL",
        (schema, MIGRATIONS_TABLE),
    ).fetchone()
    if not exists or not exists[0]:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}.{}").format(
            sql.Identifier(schema), sql.Identifier(MIGRATIONS_TABLE)
        )
    ).fetchall()
    return {int(str(v)): str(c) for v, c in rows}


def applied_version(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int | None:
    """The newest migration applied to `schema`, or None where postbox was never migrated into it."""
    done = applied_versions(conn, schema)
    return max(done) if done else None


def schema_state(dsn: str, schema: str) -> SchemaState | None:
    """Where `schema` stands against this postbox's migrations, or None when the database cannot tell us
    (it is down, refuses us): the caller then says what it can without it."""
    from postbox.relay.core.db import connect  # noqa: PLC0415

    try:
        with connect(dsn, schema, autocommit=True, application_name="postbox-schema-check") as conn:
            applied = applied_version(conn, schema)
    except psycopg.Error:
        return None
    return SchemaState(schema, applied, load_migrations()[-1].version)


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
    try:
        check_schema_name(schema)
    except ValueError as exc:
        raise MigrationError(str(exc)) from None
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
        _check_search_path(conn, schema)
        for migration in pending:
            conn.execute(migration.sql.encode())  # shipped files, never user input
            # No parameters beside a composed name: psycopg reads a '%' in the schema's name as one.
            conn.execute(
                sql.SQL("INSERT INTO {}.{} (version, name, checksum) VALUES ({}, {}, {})").format(
                    schema_id,
                    sql.Identifier(MIGRATIONS_TABLE),
                    sql.Literal(migration.version),
                    sql.Literal(migration.name),
                    sql.Literal(migration.checksum),
                )
            )
        if on_create is not None and created_by(pending, migrations):
            on_create(conn)
    return pending


def _check_search_path(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> None:
    """The migrations create their objects in current_schema(): make sure that is `schema` (as PostgreSQL
    names it: cut to 63 bytes), so a name search_path reads otherwise can never put the tables elsewhere."""
    found = conn.execute("SELECT current_schema(), %s::text::name", (schema,)).fetchone()
    if found is None or found[0] != found[1]:
        selected = None if found is None else found[0]
        raise MigrationError(
            f"schema {schema!r}: search_path selects {selected!r} instead, so the tables would land there; "
            "choose another name"
        )
