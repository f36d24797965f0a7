"""Named SQL queries kept in .sql files: one way to write SQL in postbox, reviewable as SQL.

A file holds blocks that each start with a line `-- name: <query_name>`; the text up to the next such line
is the query. Queries use unqualified table names: the connection's search_path picks the schema.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import LiteralString, cast

from psycopg import sql

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


class UnknownQuery(KeyError):
    pass


def parse_queries(text: str) -> dict[str, LiteralString]:
    """Split a .sql file's text into its named queries (pure: no file access)."""
    parts = _NAME_LINE.split(text)
    queries: dict[str, LiteralString] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        # The files ship with the package; they are constants, never user input.
        queries[name] = cast(LiteralString, body.strip())
    return queries


@cache
def load_queries(path: Path) -> dict[str, LiteralString]:
    return parse_queries(path.read_text())


def query(path: Path, name: str) -> LiteralString:
    queries = load_queries(path)
    try:
        return queries[name]
    except KeyError:
        raise UnknownQuery(f"no query named {name!r} in {path.name}") from None


def name_for_parameters(*names: str) -> sql.SQL:
    """A quoted (qualified) name for a statement that also takes %s parameters. psycopg reads a '%' anywhere
    in the composed text as a placeholder, a quoted name's too: sql.Identifier('a%sb') beside VALUES (%s)
    made "the query has 4 placeholders but 3 parameters". Each '%' is doubled here, as SQL text needs."""
    quoted = sql.Identifier(*names).as_string(None)
    return sql.SQL(quoted.replace("%", "%%"))


def schema_name_problem(name: str) -> str | None:
    """Why postbox cannot keep its tables in a schema of this name, or None when it can. Every other name
    PostgreSQL accepts works (quotes, spaces, '%', '.', unicode...): postbox always passes it quoted. A
    name over 63 bytes works too, as PostgreSQL cuts it (every command cuts it alike)."""
    if not name:
        return "is empty"
    if "\x00" in name:
        return "contains a NUL character, which PostgreSQL cannot store in a name"
    if name == "$user":
        # search_path reads $user, quoted or not, as the session user's schema: the tables would land in
        # that schema or in public, and no connection could select this one.
        return "means the session user's own schema in search_path, so no connection could select it"
    if name.startswith("pg_"):
        return "begins 'pg_', which PostgreSQL reserves for its system schemas"
    return None


def check_schema_name(name: str) -> str:
    """`name`, or ValueError saying why postbox cannot use it (schema_name_problem)."""
    problem = schema_name_problem(name)
    if problem is not None:
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise ValueError(f"schema {shown!r} {problem}")
    return name
