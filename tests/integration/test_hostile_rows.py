"""The hostile-input rule as a mechanism (real servers, real processes): a setting that would reach a
formatter is refused at start; a row whose preparation raises anything is parked with a reason that quotes
none of its contents, and the rows after it flow; a schema name that needs quoting migrates twice and a
relay publishes from it.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from postbox.relay.core.db import connect
from postbox.relay.core.migrate import load_migrations
from postbox.relay.core.sql import name_for_parameters
from tests.support.database import written_state
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES
from tests.support.processes import RelayProcess
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]

# Values Python cannot load although PostgreSQL stores them in a jsonb column: an integer past Python's
# 4,300-digit limit for int(str) (ValueError), and arrays nested past the interpreter's recursion limit
# (RecursionError). psycopg loads jsonb with json.loads when the batch is fetched, so before the per-row
# guard either one failed the whole claim, and the relay exited on it at every restart.
HUGE_NUMBER = "1" + "0" * 5000
DEEP_ARRAY = "[" * 3000 + "]" * 3000


def insert(db: Conn, kind: str, aggregate_id: str, headers: str | None = None) -> int:
    found = db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
        "VALUES (%s, %s, 'Changed', '{}', coalesce(%s::jsonb, '{}')) RETURNING id",
        (kind, aggregate_id, headers),
    ).fetchone()
    assert found is not None
    return int(str(found[0]))


def row_states(db: Conn, ids: list[int]) -> dict[int, tuple[str, str | None]]:
    found = db.execute("SELECT id, state, last_error FROM outbox WHERE id = ANY(%s)", (ids,)).fetchall()
    return {int(str(i)): (str(s), None if e is None else str(e)) for i, s, e in found}


# -- settings that reach a formatter -------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "outbox.{aggregate_type:>99999999}",  # a 100 MB topic per row
        "outbox.{aggregate_type:d}",  # ValueError on every row
        "outbox.{aggregate_type!r}",  # quotes in every topic: every row parked
        "outbox.{aggregate_type[0]}",
        "outbox event.{aggregate_type}",  # a space: no row could ever be published
    ],
)
def test_a_topic_template_that_is_not_plain_placeholders_is_refused_at_start(
    servers: Servers, schema: str, db: Conn, template: str, relay_mode: str
) -> None:
    row_id = insert(db, f"tpl{uuid.uuid4().hex[:6]}", "a-1")
    with RelayProcess(
        servers.database_url, servers.kafka_bootstrap, schema, "--topic-template", template
    ) as relay:
        try:
            code = relay.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        log = relay.log()
    assert code == 2, f"exit {code}, expected a refusal at start:\n{log[-2000:]}"
    assert "--topic-template (POSTBOX_RELAY_TOPIC_TEMPLATE)" in log, log[-2000:]
    assert row_states(db, [row_id])[row_id] == (written_state(relay_mode), None), "nothing read or parked"


# -- rows whose preparation raises ---------------------------------------------------------------------


@BOTH_MODES
def test_a_row_whose_preparation_raises_is_parked_and_the_rows_after_it_flow(
    servers: Servers, schema: str, db: Conn, relay_mode: str
) -> None:
    kind = f"prep{uuid.uuid4().hex[:6]}"
    before = [insert(db, kind, f"a-{i % 2}") for i in range(5)]
    hostile = {
        "a header number Python cannot read": insert(db, kind, "a-0", f'{{"n": {HUGE_NUMBER}}}'),
        "a header nested past the recursion limit": insert(db, kind, "a-1", f'{{"n": {DEEP_ARRAY}}}'),
    }
    # The same aggregates as the hostile rows, after them: a parked row holds nothing back.
    after = [insert(db, kind, f"a-{i % 2}") for i in range(5)]
    ordinary = before + after

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(
            lambda: (
                all(s == "failed" for s, _ in row_states(db, list(hostile.values())).values())
                or relay.process.poll() is not None
            ),
            60,
            what="the hostile rows parked",
        )
        records = read_topic(
            servers.kafka_bootstrap, f"outbox.event.{kind}", expected=len(ordinary), timeout=30
        )
        assert relay.process.poll() is None, "the relay exited:\n" + relay.log()[-3000:]
        assert relay.terminate() == 0
        log = relay.log()

    states = row_states(db, list(hostile.values()))
    for label, row_id in hostile.items():
        state, reason = states[row_id]
        assert state == "failed", (label, state, reason)
        assert reason is not None, label
        assert HUGE_NUMBER[:20] not in reason, "the reason quotes no contents"
        assert "[[[" not in reason, "the reason quotes no contents"
    assert "ValueError" in str(states[hostile["a header number Python cannot read"]][1])
    assert "RecursionError" in str(states[hostile["a header nested past the recursion limit"]][1])
    assert "relay_row_unpreparable" in log, "the exception's class is logged"
    assert HUGE_NUMBER[:40] not in log
    ids = {
        str(r[0]): int(str(r[1]))
        for r in db.execute("SELECT event_id::text, id FROM outbox WHERE aggregate_type = %s", (kind,))
    }
    delivered = Counter(ids[r.headers["id"].decode()] for r in records)
    assert set(delivered) == set(ordinary), "every ordinary row, before and after, published"


# -- schema names --------------------------------------------------------------------------------------

# Quotes, a percent sign (psycopg's placeholder character), spaces, a dot, a semicolon, upper case and
# non-ASCII letters: 38 bytes, under PostgreSQL's 63.
ODD_SCHEMA = 'Odd "Schema" 50%s; x.y-ü'


@pytest.fixture
def odd_schema(servers: Servers) -> Iterator[str]:
    name = f"{ODD_SCHEMA} {uuid.uuid4().hex[:6]}"
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def postbox(servers: Servers, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args, "--database-url", servers.database_url],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_a_schema_name_that_needs_quoting_migrates_twice_and_a_relay_publishes_from_it(
    servers: Servers, odd_schema: str
) -> None:
    first = postbox(servers, "migrate", "--schema", odd_schema)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "applied 0001_outbox" in first.stdout
    second = postbox(servers, "migrate", "--schema", odd_schema)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "already up to date" in second.stdout
    status = postbox(servers, "relay", "status", "--schema", odd_schema)
    assert status.returncode == 0, status.stderr[-2000:]
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        # The name beside %s parameters (as enqueue(schema=...) composes one): its '%' are not placeholders.
        statement = sql.SQL("SELECT count(*) FROM {} WHERE version >= %s").format(
            name_for_parameters(odd_schema, "postbox_migrations")
        )
        assert conn.execute(statement, (1,)).fetchone() == (len(load_migrations()),)

    kind = f"odd{uuid.uuid4().hex[:6]}"
    with connect(servers.database_url, odd_schema, autocommit=True) as db:
        ids = [insert(db, kind, f"a-{i % 3}") for i in range(20)]
        events = {
            str(r[0]) for r in db.execute("SELECT event_id::text FROM outbox WHERE id = ANY(%s)", (ids,))
        }
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, odd_schema) as relay:
            records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=len(ids))
            assert relay.process.poll() is None, relay.log()[-3000:]
            assert relay.terminate() == 0
    assert {r.headers["id"].decode() for r in records} == events


def test_a_schema_name_search_path_cannot_address_is_refused_not_migrated_elsewhere(
    servers: Servers,
) -> None:
    """`$user` in search_path means the session user's schema, quoted or not: migrating "$user" put every
    table into public (or into the role's own schema) and recorded it as migrated. Run inside a transaction
    that is rolled back, so that the code as it was leaves no trace in the shared database."""
    from postbox.relay.core.migrate import MigrationError, migrate  # noqa: PLC0415

    with psycopg.connect(servers.database_url) as conn:
        try:
            with conn.transaction(force_rollback=True), pytest.raises(MigrationError, match=r"\$user"):
                migrate(conn, "$user")
        finally:
            conn.rollback()
