"""Ordinary operator mistakes (a wrong database, role or password, a server that is down, a schema that was
never migrated) as one line and an exit code, instead of a traceback. Pure: `explain` maps an exception, and
what the caller found out about the schema, to the line and the code; the CLI's dispatch prints them.

The exit codes follow sysexits.h, which service managers and shells already know:
69 EX_UNAVAILABLE (a server cannot be reached: try again later), 77 EX_NOPERM (the server refuses these
credentials), 78 EX_CONFIG (the configuration names something that is not there, or a schema that is not
migrated). docs/reference/exit-codes.md lists them with postbox's own 1, 2 and 3.

A connection refused by the server reaches the client with no SQLSTATE: libpq keeps only the text of the
server's FATAL message (psycopg's OperationalError then has sqlstate None), so those are recognised by
PostgreSQL's English message texts. A server whose lc_messages is another language is not recognised: its
refusals count as "unavailable" (69, and a daemon keeps retrying), which is what happened before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass

import psycopg

from postbox.relay.core.redact import scrub

EX_UNAVAILABLE = 69
EX_NOPERM = 77
EX_CONFIG = 78

MIGRATE_HINT = "run `postbox migrate --schema {schema}`"


# The schema a command works in when its settings do not name it (the inbox's app names its own): set by
# the command once it knows, read by the CLI's dispatch to name the schema in the line.
SCHEMA_IN_USE: ContextVar[str | None] = ContextVar("postbox_schema_in_use", default=None)


@dataclass(frozen=True)
class OperatorError:
    """What to tell the operator: one line, and the process's exit code."""

    message: str
    exit_code: int


class OperatorMistake(Exception):
    """Raised by a command that found an operator's mistake itself (a schema that is not migrated, seen at
    a daemon's start): the dispatch prints `problem` like any other."""

    def __init__(self, problem: OperatorError) -> None:
        super().__init__(problem.message)
        self.problem = problem


@dataclass(frozen=True)
class SchemaState:
    """What the caller found in the schema after an error about a missing table, column or function."""

    schema: str
    applied: int | None  # the newest migration applied there; None: postbox was never migrated into it
    latest: int  # the newest migration this postbox ships


# The server's refusals at connect time, by their message (see the module's docstring), most specific first.
# Each: pattern, exit code, what it means for the operator.
_REFUSALS: tuple[tuple[re.Pattern[str], int, str], ...] = (
    (re.compile(r'database "[^"]*" does not exist'), EX_CONFIG, "check the database name in the URL"),
    (re.compile(r'role "[^"]*" does not exist'), EX_NOPERM, "check the user name in the URL"),
    (
        re.compile(r'password authentication failed for user "[^"]*"'),
        EX_NOPERM,
        "a wrong password, or a role that does not exist",
    ),
    (re.compile(r"\w+ authentication failed for user"), EX_NOPERM, "check the URL's credentials"),
    (re.compile(r"no pg_hba\.conf entry for"), EX_NOPERM, "the server's pg_hba.conf refuses this connection"),
    (re.compile(r'role "[^"]*" is not permitted to log in'), EX_NOPERM, "the role lacks LOGIN"),
    (re.compile(r'permission denied for database "[^"]*"'), EX_NOPERM, "the role lacks CONNECT on it"),
    (re.compile(r"no password supplied"), EX_NOPERM, "the server wants a password and the URL has none"),
)

# Server-side SQLSTATEs of the same mistakes, for when an error does carry one (a statement's error).
_STATES = {
    "3D000": EX_CONFIG,  # invalid_catalog_name: the database does not exist
    "28000": EX_NOPERM,  # invalid_authorization_specification
    "28P01": EX_NOPERM,  # invalid_password
    "42501": EX_NOPERM,  # insufficient_privilege: a GRANT is missing
}
# A table, schema, function or column postbox needs is missing: a schema not migrated, or migrated by an
# older postbox than this one.
_SCHEMA_STATES = frozenset({"42P01", "3F000", "42883", "42703"})
# The database is gone or struggling (relay.core.db's classes of "unavailable").
_UNAVAILABLE_CLASSES = frozenset({"08", "53", "57", "58"})


def needs_schema_state(exc: BaseException) -> bool:
    """Whether `explain` can tell more about `exc` with the schema's migration state: an error about a
    table, schema, function or column that is not there."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate in _SCHEMA_STATES


def server_text(exc: BaseException) -> str:
    """The useful line of a connection error: the server's FATAL message when there is one, else libpq's
    reason after its "connection to server at ... failed:" preamble."""
    text = str(exc).strip()
    fatal: list[str] = re.findall(r"FATAL:\s+(.*)", text)
    if fatal:
        return fatal[-1].strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first.removeprefix("connection failed: ").strip()


def refused_connection(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, what it means) when `exc` is the server refusing a connection for good: the database or
    role does not exist, the password is wrong, pg_hba.conf or a grant refuses it. None for anything else,
    a server that is down or busy included. Retrying cannot fix a refusal; a daemon should stop on one."""
    if not isinstance(exc, psycopg.OperationalError):
        return None
    if exc.sqlstate is not None:
        code = _STATES.get(exc.sqlstate)
        return (code, "") if code is not None else None  # the server's message says it all
    text = server_text(exc)
    for pattern, code, meaning in _REFUSALS:
        if pattern.search(text):
            return code, meaning
    return None


def permanent_connect_failure(exc: BaseException) -> bool:
    """Whether a daemon should stop on `exc` rather than reconnect (see refused_connection)."""
    return refused_connection(exc) is not None


def explain(
    exc: BaseException,
    *,
    schema: str | None = None,
    state: SchemaState | None = None,
    secrets: Iterable[str | None] = (),
) -> OperatorError | None:
    """The line and exit code for `exc` when it is an ordinary operator mistake; None when it is not (a
    bug, which keeps its traceback).

    schema: the schema the command works in, when known. state: what the caller found in that schema after
    an error about a missing object (None: not looked, or the lookup failed). secrets: strings that must not
    appear in the line (the URL's password), masked should a message ever quote them."""
    found = _explain(exc, schema, state)
    if found is None:
        return None
    return OperatorError(scrub(found.message, *secrets), found.exit_code)


def _explain(exc: BaseException, schema: str | None, state: SchemaState | None) -> OperatorError | None:
    from postbox.relay.core.migrate import MigrationError  # noqa: PLC0415  (migrate needs this module's SchemaState)

    if isinstance(exc, OperatorMistake):
        return exc.problem
    if isinstance(exc, MigrationError):
        return OperatorError(f"migration refused: {exc}", EX_CONFIG)
    if not isinstance(exc, psycopg.Error):
        return None
    if exc.sqlstate in _SCHEMA_STATES:
        return _schema_problem(exc.diag.message_primary or server_text(exc), schema, state)
    return _database_error(exc)


def _database_error(exc: psycopg.Error) -> OperatorError | None:
    sqlstate = exc.sqlstate
    primary = exc.diag.message_primary or server_text(exc)
    refused = refused_connection(exc)
    found: OperatorError | None = None
    if refused is not None:
        code, meaning = refused
        said = server_text(exc) if sqlstate is None else primary
        because = f" ({meaning})" if meaning else ""
        found = OperatorError(f"database refused the connection: {said}{because}", code)
    elif sqlstate in _STATES:
        found = OperatorError(f"database refused: {primary}", _STATES[sqlstate])
    elif sqlstate is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        # No SQLSTATE: the client's own failure (refused, timed out, name not resolved, connection lost).
        found = OperatorError(f"database unavailable: {server_text(exc)}", EX_UNAVAILABLE)
    elif sqlstate is not None and sqlstate[:2] in _UNAVAILABLE_CLASSES:
        found = OperatorError(f"database unavailable: {sqlstate}: {primary}", EX_UNAVAILABLE)
    return found


def _schema_problem(primary: str, schema: str | None, state: SchemaState | None) -> OperatorError | None:
    named = f'schema "{schema}"' if schema else "the app's schema"
    hint = MIGRATE_HINT.format(schema=schema or "<the app's schema>")
    if state is None:
        return OperatorError(
            f"{named} is not migrated, or older than this postbox ({primary}): {hint}", EX_CONFIG
        )
    return schema_verdict(state, primary)


def schema_verdict(state: SchemaState, primary: str | None = None) -> OperatorError | None:
    """The problem with a schema at `state`, or None when it is current (then a missing object is a bug)."""
    named = f'schema "{state.schema}"'
    hint = MIGRATE_HINT.format(schema=state.schema)
    because = f" ({primary})" if primary else ""
    if state.applied is None:
        return OperatorError(f"{named} is not migrated{because}: {hint}", EX_CONFIG)
    if state.applied < state.latest:
        return OperatorError(
            f"{named} is at migration {state.applied:04d} and this postbox needs {state.latest:04d}"
            f"{because}: {hint}",
            EX_CONFIG,
        )
    if state.applied > state.latest:
        return OperatorError(
            f"{named} is at migration {state.applied:04d}, newer than this postbox knows "
            f"({state.latest:04d}){because}: upgrade postbox",
            EX_CONFIG,
        )
    return None
