from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.servers import Servers, provide_servers


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    with provide_servers() as found:
        yield found


@pytest.fixture
def relay_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The outbox's mode for this test: log, as `postbox migrate` makes a new outbox, unless parametrized
    (indirect=True) with "queue" (tests.support.modes: BOTH_MODES, QUEUE_ONLY). The relays the test starts
    run in --mode auto, the default, so they read the test's schema in its mode, as users' relays do (a
    test that pins one passes --mode itself)."""
    mode = str(getattr(request, "param", "log"))
    assert mode in ("log", "queue"), mode
    monkeypatch.delenv("POSTBOX_RELAY_MODE", raising=False)  # none of the environment's: auto
    return mode


@pytest.fixture
def schema(servers: Servers, relay_mode: str) -> Iterator[str]:
    """A freshly migrated schema of its own for each test (in the test's relay mode), dropped afterwards."""
    from tests.support.database import prepare_outbox  # noqa: PLC0415

    name = f"t_{uuid.uuid4().hex[:12]}"
    prepare_outbox(servers.database_url, name, relay_mode)
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
def db(servers: Servers, schema: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(servers.database_url, schema, autocommit=True) as conn:
        yield conn


@pytest.fixture
def bank(db: psycopg.Connection[tuple[object, ...]]) -> psycopg.Connection[tuple[object, ...]]:
    """`db` with the tables of tests.apps.bank (accounts, effects) in the test's schema."""
    from tests.apps.bank import SCHEMA_SQL  # noqa: PLC0415
    from tests.support.database import execute_script  # noqa: PLC0415

    execute_script(db, SCHEMA_SQL)
    return db


@pytest.fixture
def own_kafka() -> Iterator[object]:
    """A broker of this test's own, for tests that stop, pause or reconfigure it."""
    from postbox.relay.devstack.kafka import LocalKafka  # noqa: PLC0415

    kafka = LocalKafka().start()
    yield kafka
    kafka.stop()


@pytest.fixture
def own_kafka_no_autocreate() -> Iterator[object]:
    from postbox.relay.devstack.kafka import LocalKafka  # noqa: PLC0415

    kafka = LocalKafka(auto_create_topics=False).start()
    yield kafka
    kafka.stop()


@pytest.fixture
def own_postgres() -> Iterator[object]:
    """A PostgreSQL server of this test's own, for tests that crash-restart it."""
    from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir  # noqa: PLC0415

    postgres = LocalPostgres(find_bin_dir()).start()
    yield postgres
    postgres.stop()


@pytest.fixture
def logical_postgres(relay_mode: str) -> Iterator[object]:
    """A server of this test's own with wal_level=logical, for Debezium (which reads the WAL), with the
    postbox schema migrated in the test's relay mode."""
    from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir  # noqa: PLC0415
    from tests.support.database import prepare_outbox  # noqa: PLC0415

    postgres = LocalPostgres(find_bin_dir(), settings={"wal_level": "logical"}).start()
    prepare_outbox(postgres.dsn, "postbox", relay_mode)
    yield postgres
    postgres.stop()
