"""Connections to PostgreSQL, set up the same way everywhere in postbox."""

from __future__ import annotations

import hashlib

import psycopg
from psycopg import sql


def advisory_key(namespace: str, name: str) -> int:
    """A signed 64-bit advisory-lock key, stable across processes and versions (SHA-256, not hashtext)."""
    digest = hashlib.sha256(f"{namespace}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def connect(
    dsn: str, schema: str, *, autocommit: bool = False, application_name: str = "postbox", **settings: str
) -> psycopg.Connection[tuple[object, ...]]:
    """A connection whose unqualified names resolve in `schema`; `settings` are session GUCs."""
    conn = psycopg.connect(dsn, autocommit=True, application_name=application_name)
    try:
        conn.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema)))
        for name, value in settings.items():
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn
