"""Connections to PostgreSQL, set up the same way everywhere in postbox."""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.core.redact import scrub, url_password


def advisory_key(namespace: str, name: str) -> int:
    """A signed 64-bit advisory-lock key, stable across processes and versions (SHA-256, not hashtext)."""
    digest = hashlib.sha256(f"{namespace}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


DEFAULT_SCHEMA = "postbox"  # where `postbox migrate` puts the tables unless told otherwise

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


def check_database_url(dsn: str) -> None:
    """ValueError, without the password, unless libpq can parse `dsn` (checked at start, so a typo in the
    URL is a clear message naming the setting rather than a traceback from the first connect)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise ValueError(f"database-url: not a valid PostgreSQL URL: {_without_password(exc, dsn)}") from None


def _without_password(exc: psycopg.Error, dsn: str) -> str:
    """The error's text with the URL's password masked (libpq quotes the part it choked on)."""
    try:
        keyword: str | None = conninfo_to_dict(dsn).get("password")  # type: ignore[assignment]
    except psycopg.Error:
        keyword = None
    return scrub(str(exc).strip(), url_password(dsn), keyword)


def connect(
    dsn: str, schema: str, *, autocommit: bool = False, application_name: str = "postbox", **settings: str
) -> psycopg.Connection[tuple[object, ...]]:
    """A connection whose unqualified names resolve in `schema`; `settings` are session GUCs.

    A URL that cannot be parsed or used fails with the error psycopg gives, minus the password: libpq
    quotes the part of the URL it choked on, and that part is often the password."""
    try:
        conninfo = make_conninfo(dsn, **liveness_options(dsn))
        conn = psycopg.connect(conninfo, autocommit=True, application_name=application_name)
    except psycopg.Error as exc:
        message = _without_password(exc, dsn)
        if message == str(exc).strip():
            raise
        raise type(exc)(message) from None
    try:
        conn.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema)))
        for name, value in settings.items():
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


# SQLSTATE classes that say the database (not the statement) is the problem: the connection (08), the
# server's resources (53: disk full, out of memory, too many connections), an operator or a crash ending
# sessions (57: admin shutdown, crash shutdown, cannot connect now, statement cancelled), system I/O (58).
_UNAVAILABLE_CLASSES = frozenset({"08", "53", "57", "58"})


def database_unavailable(exc: BaseException, *conns: psycopg.Connection[Any] | None) -> bool:
    """Whether `exc` means "the database is gone or struggling, retry later", as opposed to "this
    statement, row or record is bad". Decided by SQLSTATE, never by Python class: psycopg files
    `program_limit_exceeded` (an index entry too large for one message id) under OperationalError, and
    that is a bad record, not a lost server. An error with no SQLSTATE is the client's (lost socket,
    failed connect); a broken connection is unavailable whatever the error says."""
    if any(conn is not None and conn.broken for conn in conns):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state[:2] in _UNAVAILABLE_CLASSES


def describe_error(exc: BaseException) -> str:
    """An error for a log line or an answer: SQLSTATE and the primary message only. str(exc) carries the
    server's DETAIL and CONTEXT lines, which quote the offending value (payload text, ids) verbatim."""
    if isinstance(exc, psycopg.Error) and exc.diag.message_primary:
        return f"{exc.sqlstate}: {exc.diag.message_primary}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def storable_text(text: str, limit: int = 2000) -> str:
    """`text` (an error message, a reason) made safe for a text column: PostgreSQL refuses NUL and, as
    UTF-8, a lone surrogate, and a reason that cannot be stored would fail the very statement that parks."""
    cleaned = text[:limit].replace("\x00", "\\0")
    return cleaned.encode("utf-8", "replace").decode("utf-8")
