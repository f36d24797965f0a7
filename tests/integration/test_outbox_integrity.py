"""A committed outbox row is published or parked with a reason, whatever a writer's role sets and wherever
the database moves (migration 0009's write guard, the stranded-rows check, `postbox relay rebase`).

The writers here connect as the servers' superuser, which owns the tables: the role most services migrate
and write with, which no GRANT restricts."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from postbox.relay.core.db import connect
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from postbox.relay.outbox import OutboxEvent, enqueue_many
from tests.support.delivery import check_delivery
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES, LOG_ONLY
from tests.support.probes import http_get, metric_value
from tests.support.processes import RelayProcess
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]
COLUMNS = "aggregate_type, aggregate_id, event_type, payload"


def _postbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def _forged_inserts(mode: str) -> list[tuple[str, str]]:
    """(column, the INSERT's extra column and value) for every way a writer could strand a row."""
    other_state = "pending" if mode == "log" else "logged"
    return [
        ("txid", "txid, '3'"),  # a transaction long finished
        ("txid", "txid, (pg_current_xact_id()::text::bigint - 5)::text::xid8"),  # just behind
        ("txid", "txid, (pg_current_xact_id()::text::bigint + 50000000)::text::xid8"),  # far ahead
        ("txid", "txid, '0'"),  # the parked rows' partition, as a live row
        ("state", "state, 'published'"),
        ("state", "state, 'failed'"),
        ("state", f"state, '{other_state}'"),  # the other mode's state: read by no relay of this one
    ]


@BOTH_MODES
def test_the_database_refuses_a_txid_or_state_a_writer_sets_naming_the_column(
    servers: Servers, schema: str, db: Conn, relay_mode: str
) -> None:
    aggregate_type = f"guard{uuid.uuid4().hex[:6]}"
    values = f"'{aggregate_type}', 'a-1', 'Forged', '{{}}'"
    for column, extra in _forged_inserts(relay_mode):
        name, value = extra.split(", ", 1)
        with pytest.raises(psycopg.Error) as refused:
            db.execute(f"INSERT INTO outbox ({COLUMNS}, {name}) VALUES ({values}, {value})")
        assert refused.value.sqlstate == "428C9", extra
        assert refused.value.diag.column_name == column, extra
        assert f"outbox.{column}" in (refused.value.diag.message_primary or ""), extra
    # A row written the ordinary way, then updates that would strand it: refused too.
    [event_id] = enqueue_many(db, [OutboxEvent(aggregate_type, "a-1", "Placed", {"n": 1})], schema=schema)
    stranding_updates = [
        ("txid", "txid = '3'"),
        ("state", "state = 'logged'") if relay_mode == "queue" else ("state", "state = 'published'"),
    ]
    for column, assignment in stranding_updates:
        with pytest.raises(psycopg.Error) as refused:
            db.execute(f"UPDATE outbox SET {assignment} WHERE event_id = %s", (event_id,))
        assert (refused.value.sqlstate, refused.value.diag.column_name) == ("428C9", column), assignment
    assert db.execute("SELECT count(*) FROM outbox").fetchone() == (1,), "nothing forged was written"
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema):
        records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", 1)
    assert [r.headers["id"].decode() for r in records] == [str(event_id)]


@LOG_ONLY  # rows no cursor reaches: log mode's (a queue-mode outbox reads every pending row)
def test_stranded_rows_are_counted_named_alerted_and_requeued(
    servers: Servers, schema: str, db: Conn
) -> None:
    """However a row got where no cursor reaches (here written as logical replication applies rows, with
    the session's triggers off, as a moved database or a superuser's write would leave it), the relay
    counts it, status names it, requeue sends it."""
    aggregate_type = f"stranded{uuid.uuid4().hex[:6]}"
    values = f"'{aggregate_type}', 'a-1', 'Stranded', '{{}}'"
    db.execute("SET session_replication_role = replica")
    ids = [
        db.execute(f"INSERT INTO outbox ({COLUMNS}, txid) VALUES ({values}, {txid}) RETURNING id").fetchone()
        for txid in ("'3'", "(pg_current_xact_id()::text::bigint + 50000000)::text::xid8")
    ]
    db.execute("SET session_replication_role = DEFAULT")
    stranded_ids = sorted(int(str(row[0])) for row in ids if row is not None)
    [fine] = enqueue_many(db, [OutboxEvent(aggregate_type, "b-1", "Fine", {})], schema=schema)

    status = _postbox("relay", "status", "--database-url", servers.database_url, "--schema", schema)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].split() == ["backlog", "3", "rows"], status.stdout  # the fine row and the stranded
    assert any(line.split()[:2] == ["stranded", "2"] for line in lines), status.stdout
    assert f"ids {stranded_ids[0]}, {stranded_ids[1]}:" in status.stdout

    topic = f"outbox.event.{aggregate_type}"
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        read_topic(servers.kafka_bootstrap, topic, 1)

        def stranded_gauge() -> float:
            code, text = http_get(relay.metrics_port, "/metrics")
            return metric_value(text, "postbox_relay_stranded_rows") if code == 200 else -1.0

        wait_until(lambda: stranded_gauge() == 2, 30, what="the stranded-rows gauge")
        assert "relay_rows_stranded" in relay.log()
        requeued = _postbox(
            "relay", "requeue", "--stranded", "--database-url", servers.database_url, "--schema", schema
        )
        assert requeued.stdout.startswith("requeued 2 rows"), requeued.stdout + requeued.stderr
        records = read_topic(servers.kafka_bootstrap, topic, 3)
        wait_until(lambda: stranded_gauge() == 0, 30, what="the gauge back to 0")
    assert len({r.headers["id"] for r in records}) == 3
    assert str(fine) in {r.headers["id"].decode() for r in records}


@pytest.fixture
def fresh_cluster() -> Iterator[LocalPostgres]:
    """A PostgreSQL cluster just made: its transaction counter is far below a server that has run."""
    postgres = LocalPostgres(find_bin_dir()).start()
    yield postgres
    postgres.stop()


def _burn_transaction_ids(conn: Conn, count: int) -> None:
    """Move the counter on by `count`: each subtransaction that writes takes an id of its own."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS burn (n int)")
    conn.execute(
        f"DO $$ BEGIN FOR i IN 1..{int(count)} LOOP BEGIN INSERT INTO burn VALUES (i); "
        "EXCEPTION WHEN OTHERS THEN NULL; END; END LOOP; END $$"
    )


@LOG_ONLY  # a log written on another cluster (queue mode keeps no snapshots to be foreign)
def test_a_database_dumped_and_restored_into_a_fresh_cluster_loses_nothing(
    servers: Servers, schema: str, db: Conn, fresh_cluster: LocalPostgres
) -> None:
    """The documented procedure (docs/how-to/move-the-database.md): dump, restore into a cluster whose
    counter is far lower, and the relay refuses the foreign log until `postbox relay rebase`; then every
    event arrives once, in order, those written on the new cluster before and after the rebase included."""
    aggregate_type = f"moved{uuid.uuid4().hex[:6]}"
    topic = f"outbox.event.{aggregate_type}"
    written: dict[str, tuple[str, int]] = {}
    seq = {"n": 0}

    def write(conn: Conn, count: int) -> None:
        events = []
        for _ in range(count):
            aggregate = f"order-{seq['n'] % 5}"
            events.append(OutboxEvent(aggregate_type, aggregate, "Changed", {"seq": seq["n"]}))
            written[str(events[-1].event_id)] = (aggregate, seq["n"])
            seq["n"] += 1
        with conn.transaction():
            enqueue_many(conn, events, schema=schema)

    with psycopg.connect(servers.database_url, autocommit=True) as burner:
        _burn_transaction_ids(burner, 20_000)  # the old cluster's counter, far above a fresh one's
    write(db, 20)  # published on the old cluster
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        read_topic(servers.kafka_bootstrap, topic, 20)
        assert relay.terminate() == 0
    write(db, 20)  # committed, not yet published when the database moves

    bin_dir = find_bin_dir()
    dump = subprocess.run(
        [str(bin_dir / "pg_dump"), "--no-owner", "--schema", schema, servers.database_url],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    restored = subprocess.run(
        [str(bin_dir / "psql"), "-v", "ON_ERROR_STOP=1", "-q", fresh_cluster.dsn],
        input=dump,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert restored.returncode == 0, restored.stderr[-2000:]
    new_url = fresh_cluster.dsn

    with RelayProcess(new_url, servers.kafka_bootstrap, schema) as relay:
        assert relay.process.wait(timeout=60) == 2, relay.log()[-3000:]
    assert "postbox relay rebase" in relay.log()
    status = _postbox("relay", "status", "--database-url", new_url, "--schema", schema)
    assert status.stdout.startswith("NOT PUBLISHING: the outbox's log was written on another cluster")

    with connect(new_url, schema) as new_db:
        write(new_db, 10)  # on the new cluster, before the rebase
        rebased = _postbox("relay", "rebase", "--database-url", new_url, "--schema", schema)
        assert rebased.returncode == 0, rebased.stdout + rebased.stderr
        assert "20 marked published" in rebased.stdout, rebased.stdout
        write(new_db, 10)  # and after it
        with RelayProcess(new_url, servers.kafka_bootstrap, schema):
            records = read_topic(servers.kafka_bootstrap, topic, len(written), settle=2.0)
    counts = check_delivery(records, written)
    assert counts["duplicates"] == 0, "nothing was in flight when the database moved"


def _same_shard(db: Conn, aggregate: str, prefix: str) -> str:
    """An aggregate id starting with `prefix` in the same shard as `aggregate`."""
    wanted = db.execute("SELECT outbox_shard_of(%s)", (aggregate,)).fetchone()
    for i in range(10_000):
        candidate = f"{prefix}-{i}"
        if db.execute("SELECT outbox_shard_of(%s)", (candidate,)).fetchone() == wanted:
            return candidate
    raise AssertionError("no aggregate id in the same shard")


@BOTH_MODES
def test_a_missing_topic_holds_back_only_its_aggregate_never_the_rest_of_its_shard(
    servers: Servers, schema: str, db: Conn, own_kafka_no_autocreate: Any, relay_mode: str
) -> None:
    """An event routed to a topic that does not exist holds back its aggregate, never the other aggregates
    of its shard; once the topic exists, the held events go out in their order. What is held differs by
    design (docs/explanation/failure-behaviour.md): in log mode the event and its aggregate's later events
    (a cursor cannot pass them) are parked as held; in queue mode the event stays pending, skipped by the
    claim, and its aggregate's events for other topics go out (order holds per topic)."""
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415

    kafka = own_kafka_no_autocreate
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    admin.create_topics([NewTopic("outbox.event.known", 1, 1)])["outbox.event.known"].result(30)
    held, flowing = "held-0", _same_shard(db, "held-0", "flowing")
    with db.transaction():
        [first] = enqueue_many(
            db, [OutboxEvent("known", held, "E", {"n": 0}, topic="outbox.event.missing")], schema=schema
        )
        later = enqueue_many(db, [OutboxEvent("known", held, "E", {"n": n}) for n in (1, 2)], schema=schema)
        others = enqueue_many(
            db, [OutboxEvent("known", flowing, "E", {"n": n}) for n in range(3)], schema=schema
        )
    with RelayProcess(
        servers.database_url, kafka.bootstrap, schema, "--topic-recheck-interval", "1"
    ) as relay:
        parked_query = "SELECT event_id::text, held_for FROM outbox WHERE state = 'failed' ORDER BY id"
        if relay_mode == "log":
            records = read_topic(kafka.bootstrap, "outbox.event.known", 3, settle=3.0)
            assert [r.headers["id"].decode() for r in records] == [str(e) for e in others], (
                "the other aggregate of the shard flows; the held aggregate's later events wait"
            )
            parked = db.execute(parked_query).fetchall()
            assert parked == [(str(e), "outbox.event.missing") for e in (first, *later)]
        else:
            records = read_topic(kafka.bootstrap, "outbox.event.known", 5, settle=3.0)
            # In their order, each first copy: the held aggregate's events sent in the batch where its
            # first one failed are not marked, so that nothing overtakes it, and go again (duplicates).
            first_copies = {
                key: list(dict.fromkeys(r.headers["id"].decode() for r in records if r.key == key.encode()))
                for key in (held, flowing)
            }
            assert first_copies == {held: [str(e) for e in later], flowing: [str(e) for e in others]}, (
                "the other aggregate of the shard flows, and so do the held aggregate's events for this topic"
            )
            assert db.execute(parked_query).fetchall() == [], "nothing parked"
            state = db.execute("SELECT state FROM outbox WHERE event_id = %s", (first,)).fetchone()
            assert state == ("pending",), "the held event stays pending"
        admin.create_topics([NewTopic("outbox.event.missing", 1, 1)])["outbox.event.missing"].result(30)
        records = read_topic(kafka.bootstrap, "outbox.event.known", 5)
        missing = read_topic(kafka.bootstrap, "outbox.event.missing", 1)
        assert relay.terminate() == 0
    known = [r.headers["id"].decode() for r in records]
    if relay_mode == "log":  # held, then sent once the topic took messages
        assert known[3:] == [str(e) for e in later]
        assert len(known) == 5, "each once"
    assert set(known) == {str(e) for e in (*later, *others)}
    assert [r.headers["id"].decode() for r in missing] == [str(first)]
    assert db.execute("SELECT count(*) FROM outbox WHERE state = 'failed'").fetchone() == (0,)
