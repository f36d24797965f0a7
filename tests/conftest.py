from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from relay.core.migrate import migrate
from tests.servers import Servers, provide_servers


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    with provide_servers() as found:
        yield found


@pytest.fixture
def schema(servers: Servers) -> Iterator[str]:
    """A freshly migrated schema of its own for each test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        migrate(conn, name)
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
def db(servers: Servers, schema: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    from relay.core.db import connect  # noqa: PLC0415

    with connect(servers.database_url, schema, autocommit=True) as conn:
        yield conn
