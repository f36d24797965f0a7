"""Named SQL queries kept in .sql files: one way to write SQL in postbox, reviewable as SQL.

A file holds blocks that each start with a line `-- name: <query_name>`; the text up to the next such line
is the query. Queries use unqualified table names: the connection's search_path picks the schema.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import LiteralString, cast

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
