"""Connections to PostgreSQL, set up the same way everywhere in postbox."""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postbox.relay.core.operator_errors import permanent_connect_failure
from postbox.relay.core.redact import scrub, url_password


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
    if permanent_connect_failure(exc):  # no such database or role, a wrong password: stop, do not retry
        return False
    if any(conn is not None and conn.broken for conn in conns):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state[:2] in _UNAVAILABLE_CLASSES


# SQLSTATEs that say "this statement lost a race, the same work run again later succeeds", with a
# connection that is still usable. None of them says anything about the row or message being worked on,
# so none may park one:
_TRANSIENT_STATES = frozenset(
    {
        "40001",  # serialization_failure: a REPEATABLE READ/SERIALIZABLE conflict, or a hot standby
        #           cancelling a query that conflicts with recovery; PostgreSQL's own advice is to retry
        "40P01",  # deadlock_detected: this session was chosen to break a lock cycle with another one
        "55P03",  # lock_not_available: lock_timeout expired, or NOWAIT met a lock someone else holds
        "72000",  # snapshot_too_old (old_snapshot_threshold, up to PostgreSQL 16): a new snapshot works
        # Ending the session, not just the statement (so database_unavailable also counts them, through
        # the broken connection): the server timed out a transaction of ours, on a new connection the
        # same work goes through.
        "25P03",  # idle_in_transaction_session_timeout
        "25P04",  # transaction_timeout (PostgreSQL 17)
    }
)
# Not transient, although they also come from concurrency: 40002 (a deferred constraint failing at commit:
# the data), 23505 and the other integrity errors (the data), 25P02 (a statement after a failed one in the
# same transaction: the caller's bug). 57014 (query_canceled: statement_timeout or pg_cancel_backend) is
# class 57, which database_unavailable counts already.
_CAUSE_DEPTH = 8  # how far down an exception's explicit causes (raise ... from) to look


def transient_database_error(exc: BaseException, *conns: psycopg.Connection[Any] | None) -> bool:
    """Whether `exc` is a database error that is nobody's bad input: retry the work (the statement's
    transaction, the batch) later, never park the row or message it was about, never stop the daemon.

    True for everything database_unavailable counts (the connection, the server's resources, an operator
    or a crash ending sessions, statement timeouts: class 57) and for the statement-level losers of a race
    (_TRANSIENT_STATES: deadlocks, serialization failures, lock timeouts). Decided by SQLSTATE. An
    exception raised `from` a database error (an application's handler wrapping it) is judged by that
    error: the first psycopg error among its explicit causes."""
    if database_unavailable(exc, *conns):
        return True
    error = _database_error_in(exc)
    if error is None:
        return False
    return error.sqlstate in _TRANSIENT_STATES or database_unavailable(error)


def _database_error_in(exc: BaseException) -> psycopg.Error | None:
    """`exc` when it is a psycopg error, else the first one among its explicit causes."""
    current: BaseException | None = exc
    for _ in range(_CAUSE_DEPTH):
        if current is None:
            return None
        if isinstance(current, psycopg.Error):
            return current
        current = current.__cause__
    return None


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
