"""Connections to PostgreSQL, set up the same way everywhere in postbox."""

from __future__ import annotations

import hashlib

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def advisory_key(namespace: str, name: str) -> int:
    """A signed 64-bit advisory-lock key, stable across processes and versions (SHA-256, not hashtext)."""
    digest = hashlib.sha256(f"{namespace}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# A network that silently drops packets (a partition, a dead NAT entry) would otherwise leave a libpq
# client waiting for TCP retransmissions to give up, many minutes. These make a dead peer an error within
# seconds, so the retry loops take over. A value given in the connection URL wins.
LIVENESS = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "20000",  # ms: unacknowledged data for this long ends the connection
}


def liveness_options(dsn: str) -> dict[str, str]:
    """LIVENESS less whatever the URL sets itself."""
    given = conninfo_to_dict(dsn)
    return {key: value for key, value in LIVENESS.items() if key not in given}


def connect(
    dsn: str, schema: str, *, autocommit: bool = False, application_name: str = "postbox", **settings: str
) -> psycopg.Connection[tuple[object, ...]]:
    """A connection whose unqualified names resolve in `schema`; `settings` are session GUCs."""
    conninfo = make_conninfo(dsn, **liveness_options(dsn))
    conn = psycopg.connect(conninfo, autocommit=True, application_name=application_name)
    try:
        conn.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema)))
        for name, value in settings.items():
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn
