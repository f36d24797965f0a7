"""Change capture on a real PostgreSQL: what `capture add` refuses (with a message that says why), what
each kind of change writes to the outbox, the options, DDL while capturing, least privilege, and the
snapshot (consistent under concurrent writers, resumable). The events' bytes are compared with Debezium's
in test_capture_debezium.py; here the outbox rows are read back as JSON.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from postbox.relay.capture.admin import (
    CaptureOptions,
    add_capture,
    list_captures,
    remove_capture,
    snapshot,
)
from tests.support.kafka import create_topic, read_topic
from tests.support.processes import InboxProcess, RelayProcess, postbox_cli
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Connection = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def app(servers: Servers, schema: str) -> Iterator[str]:
    """A schema of business tables beside the test's postbox schema, dropped afterwards."""
    name = f"{schema}_app"
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(
            f"CREATE TABLE {name}.items (id integer PRIMARY KEY, name text, price numeric(8,2), secret text)"
        )
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


def capture(db: Connection, schema: str, table: str, **options: Any) -> str:
    with db.transaction():
        return add_capture(db, schema, table, CaptureOptions(**options))


def events(db: Connection) -> list[tuple[str, str, dict[str, Any] | None, dict[str, str]]]:
    """(key, event type, value as JSON or None for a tombstone, headers) of every outbox row, in id order."""
    rows = db.execute(
        "SELECT aggregate_id, event_type, payload_bytes, headers FROM outbox ORDER BY id"
    ).fetchall()
    return [
        (key, kind, None if value is None else json.loads(value), headers)
        for key, kind, value, headers in rows
    ]


def test_add_refuses_what_it_cannot_capture_with_a_reason(db: Connection, schema: str, app: str) -> None:
    db.execute(f"CREATE TABLE {app}.no_key (a integer, b text)")
    db.execute(f"CREATE VIEW {app}.a_view AS SELECT 1 AS x")
    db.execute(f"CREATE TABLE {app}.parted (id integer PRIMARY KEY) PARTITION BY RANGE (id)")
    db.execute(f"CREATE TABLE {app}.part1 PARTITION OF {app}.parted FOR VALUES FROM (0) TO (100)")
    db.execute(f"CREATE TABLE {app}.parent (id integer PRIMARY KEY)")
    db.execute(f"CREATE TABLE {app}.child (extra text) INHERITS ({app}.parent)")
    refused = [
        (f"{app}.no_key", {}, "has no primary key"),
        (f"{app}.a_view", {}, "is not a table"),
        (f"{schema}.outbox", {}, "one of postbox's own tables"),
        (f"{app}.missing", {}, "does not exist"),
        (f"{app}.items", {"topic_prefix": "bad prefix"}, "may hold only letters"),
        (f"{app}.items", {"columns": ["name"], "exclude_columns": ["secret"]}, "not both"),
        (f"{app}.items", {"exclude_columns": ["nope"]}, "has no column nope"),
        (f"{app}.items", {"key_columns": ["nope"]}, "has no column nope"),
        (f"{app}.items", {"decimal_handling_mode": "fast"}, "must be one of"),
        (f"{app}.items", {"topic_prefix": "p" * 240}, "longer than Kafka's 249"),
        (f"{app}.parted", {}, "partitioned, a partition, or in an inheritance tree"),
        (f"{app}.part1", {}, "partitioned, a partition, or in an inheritance tree"),
        (f"{app}.parent", {}, "partitioned, a partition, or in an inheritance tree"),
        (f"{app}.child", {}, "partitioned, a partition, or in an inheritance tree"),
        (f"{app}.items", {"exclude_columns": [None]}, "has no column NULL"),
        (f"{app}.items", {"key_columns": ["id", "id"]}, "named twice"),
        (f"{app}.items", {"key_columns": []}, "an empty list of columns"),
    ]
    for table, options, reason in refused:
        with pytest.raises(psycopg.Error, match=reason):
            capture(db, schema, table, **options)
    with pytest.raises(psycopg.Error, match="name the table"):
        db.execute("SELECT capture_add(NULL)")
    assert list_captures(db, schema) == []
    assert events(db) == []
    # A table without a primary key is captured once its key is named.
    assert capture(db, schema, f"{app}.no_key", key_columns=["a"]) == f"postbox.{app}.no_key"


def test_each_change_is_an_event_in_commit_order_and_nothing_else(
    db: Connection, schema: str, app: str
) -> None:
    topic = capture(db, schema, f"{app}.items", topic_prefix="shop")
    assert topic == f"shop.{app}.items"
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1.50, 's'), (2, 'ink', 3, 's')")
    db.execute(f"UPDATE {app}.items SET price = price + 1")
    db.execute(f"DELETE FROM {app}.items WHERE id = 1")
    with db.transaction(), db.transaction():  # a subtransaction rolled back: nothing
        db.execute(f"INSERT INTO {app}.items VALUES (3, 'gone', 1, 's')")
        raise psycopg.Rollback()
    with db.transaction():  # a transaction rolled back: nothing
        db.execute(f"INSERT INTO {app}.items VALUES (4, 'gone', 1, 's')")
        raise psycopg.Rollback()
    db.execute(f"UPDATE {app}.items SET id = 5 WHERE id = 2")
    db.execute(f"TRUNCATE {app}.items")  # not captured, as Debezium's default

    got = [(key, kind, value["op"] if value else None, headers) for key, kind, value, headers in events(db)]
    assert got == [
        ('{"id":1}', "c", "c", {}),
        ('{"id":2}', "c", "c", {}),
        ('{"id":1}', "u", "u", {}),
        ('{"id":2}', "u", "u", {}),
        ('{"id":1}', "d", "d", {}),
        ('{"id":1}', "tombstone", None, {}),
        ('{"id":2}', "d", "d", {"__debezium.newkey": '{"id":5}'}),
        ('{"id":2}', "tombstone", None, {"__debezium.newkey": '{"id":5}'}),
        ('{"id":5}', "c", "c", {"__debezium.oldkey": '{"id":2}'}),
    ]
    update = events(db)[2][2]
    assert update is not None
    assert update["before"] == {"id": 1, "name": "pen", "price": "AJY=", "secret": "s"}  # 150, base64
    assert update["after"]["price"] == "APo="  # 250
    assert update["source"]["table"] == "items"
    assert update["source"]["schema"] == app
    assert update["source"]["name"] == "shop"
    rows = db.execute("SELECT DISTINCT topic, aggregate_type FROM outbox").fetchall()
    assert rows == [(topic, f"{app}.items")]


def test_a_statement_that_changes_many_keys_pairs_each_row_with_its_own_old_version(
    db: Connection, schema: str, app: str
) -> None:
    """An UPDATE's old and new rows are paired by their position in the statement, not by key: every
    new key's create names its own old key, and every delete's payload is that row's old version."""
    capture(db, schema, f"{app}.items")
    db.execute(f"INSERT INTO {app}.items SELECT i, 'n' || i, i, 's' FROM generate_series(1, 50) AS i")
    db.execute("DELETE FROM outbox")
    db.execute(f"UPDATE {app}.items SET id = id + 1000, name = name || '!' WHERE id % 2 = 0")
    got = events(db)
    assert [kind for _, kind, _, _ in got] == ["d", "tombstone", "c"] * 25
    creates = [(json.loads(h["__debezium.oldkey"])["id"], v) for _, kind, v, h in got if kind == "c"]
    for old_id, value in creates:
        assert value is not None
        assert (value["after"]["id"], value["after"]["name"]) == (old_id + 1000, f"n{old_id}!")
    deletes = [(json.loads(k)["id"], v) for k, kind, v, _ in got if kind == "d"]
    assert all(v is not None and v["before"]["name"] == f"n{key}" for key, v in deletes)
    assert db.execute(f"SELECT count(*) FROM {app}.items").fetchone()[0] == 50  # type: ignore[index]


def test_options_columns_and_tombstones(db: Connection, schema: str, app: str) -> None:
    capture(
        db,
        schema,
        f"{app}.items",
        exclude_columns=["secret"],
        tombstones_on_delete=False,
        decimal_handling_mode="string",
    )
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1.50, 'hidden')")
    db.execute(f"DELETE FROM {app}.items")
    created, deleted = [value for _, _, value, _ in events(db)]
    assert created is not None
    assert deleted is not None
    assert created["after"] == {"id": 1, "name": "pen", "price": "1.50"}
    assert deleted["op"] == "d"
    assert len(events(db)) == 2, "no tombstone with tombstones.on.delete=false"
    # Adding again changes the settings, from the next statement on.
    capture(db, schema, f"{app}.items", columns=["id", "price"], decimal_handling_mode="double")
    db.execute(f"INSERT INTO {app}.items VALUES (2, 'ink', 3, 'x')")
    assert events(db)[-1][2]["after"] == {"id": 2, "price": 3.0}  # type: ignore[index]
    [listed] = list_captures(db, schema)
    assert (listed.table, listed.columns, listed.options) == (
        f"{app}.items",
        ["id", "price"],
        {"decimal.handling.mode": "double"},
    )


def test_columns_added_and_dropped_while_capturing(db: Connection, schema: str, app: str) -> None:
    capture(db, schema, f"{app}.items")
    db.execute(f"ALTER TABLE {app}.items ADD COLUMN colour text DEFAULT 'red'")
    db.execute(f"INSERT INTO {app}.items (id, name) VALUES (1, 'pen')")
    db.execute(f"ALTER TABLE {app}.items DROP COLUMN secret")
    db.execute(f"UPDATE {app}.items SET colour = 'blue'")
    db.execute(f"ALTER TABLE {app}.items ALTER COLUMN price TYPE text")
    db.execute(f"UPDATE {app}.items SET price = 'free'")
    values = [value for _, _, value, _ in events(db)]
    assert list(values[0]["after"]) == ["id", "name", "price", "secret", "colour"]  # type: ignore[index]
    assert values[1]["before"] == {"id": 1, "name": "pen", "price": None, "colour": "red"}  # type: ignore[index]
    assert values[2]["after"]["price"] == "free"  # type: ignore[index]


def test_values_without_a_rendering_are_null_and_never_fail_the_writer(
    db: Connection, schema: str, app: str
) -> None:
    db.execute(
        f"CREATE TABLE {app}.odd (id integer PRIMARY KEY, d date, t timestamp, tz timestamptz, n numeric)"
    )
    capture(db, schema, f"{app}.odd", decimal_handling_mode="double")
    db.execute(f"INSERT INTO {app}.odd VALUES (1, 'infinity', '-infinity', 'infinity', 1e400)")
    [(_, _, value, _)] = events(db)
    assert value is not None
    assert value["after"] == {"id": 1, "d": None, "t": None, "tz": None, "n": "Infinity"}


def test_a_capture_whose_key_or_excluded_column_is_gone_fails_closed(
    db: Connection, schema: str, app: str
) -> None:
    """Without its key every row would be one key; an excluded column renamed would be published. The
    writer's statement fails with the reason instead, until the capture is added again."""
    capture(db, schema, f"{app}.items", exclude_columns=["secret"])
    db.execute(f"ALTER TABLE {app}.items RENAME COLUMN secret TO hidden")
    with pytest.raises(psycopg.Error, match="names columns it no longer has: secret"):
        db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1, 's')")
    capture(db, schema, f"{app}.items", exclude_columns=["hidden"])
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1, 's')")
    db.execute(f"ALTER TABLE {app}.items DROP CONSTRAINT items_pkey")
    with pytest.raises(psycopg.Error, match="no primary key any more"):
        db.execute(f"UPDATE {app}.items SET name = 'x'")
    assert [value["after"] for _, _, value, _ in events(db) if value] == [
        {"id": 1, "name": "pen", "price": "ZA=="}
    ]


def test_a_wide_table_is_captured(db: Connection, schema: str, app: str) -> None:
    columns = ", ".join(f"c{i} integer DEFAULT {i}" for i in range(1, 1200))
    db.execute(f"CREATE TABLE {app}.wide (id integer PRIMARY KEY, {columns})")
    capture(db, schema, f"{app}.wide")
    db.execute(f"INSERT INTO {app}.wide (id) VALUES (1)")
    [(_, _, value, _)] = events(db)
    assert value is not None
    assert len(value["after"]) == 1200
    assert value["after"]["c1199"] == 1199


def test_a_snapshot_misses_no_row_when_a_key_moves_while_its_chunk_waits(
    servers: Servers, db: Connection, schema: str, app: str
) -> None:
    """A writer moves row 30's key far ahead and commits while the chunk of rows 21-40 waits for that row's
    lock. The chunk must not take the moved key for its end (the rows between would never be read):
    every row's last event is its final version, and every row has one."""
    db.execute(f"INSERT INTO {app}.items SELECT i, 'n' || i, 1, 's' FROM generate_series(1, 100) AS i")
    capture(db, schema, f"{app}.items")
    chunk = f"SELECT capture_snapshot_chunk('{app}.items'::regclass, 20)"
    with db.transaction():
        db.execute(chunk)  # rows 1-20
    with psycopg.connect(servers.database_url) as writer:
        writer.execute(f"UPDATE {app}.items SET id = 5000 WHERE id = 30")  # holds the row
        waiting = threading.Thread(target=lambda: db.execute(f"BEGIN; {chunk}; COMMIT"))
        waiting.start()
        wait_until(
            lambda: (
                writer.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
                ).fetchone()[0]  # type: ignore[index]
                > 0
            ),
            10,
            what="the chunk waiting for the writer's row",
        )
        writer.commit()
        waiting.join(timeout=30)
    snapshot(db, schema, f"{app}.items", chunk_rows=20)
    last: dict[int, dict[str, Any] | None] = {}
    for key, _, value, _ in events(db):
        last[json.loads(key)["id"]] = None if value is None else value["after"]
    final = {row[0]: row[1] for row in db.execute(f"SELECT id, name FROM {app}.items")}
    assert {key: row["name"] for key, row in last.items() if row is not None} == final
    reads = [json.loads(key)["id"] for key, kind, _, _ in events(db) if kind == "r"]
    assert sorted(set(reads)) == sorted(final), "one read event per row"


def test_a_writer_needs_no_right_on_the_outbox(
    servers: Servers, db: Connection, schema: str, app: str
) -> None:
    capture(db, schema, f"{app}.items")
    role = f"writer_{uuid.uuid4().hex[:8]}"
    db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    try:
        db.execute(f"GRANT USAGE ON SCHEMA {app} TO {role}")
        db.execute(f"GRANT INSERT, UPDATE, DELETE, SELECT ON {app}.items TO {role}")
        url = psycopg.conninfo.make_conninfo(servers.database_url, user=role, password="pw")
        with psycopg.connect(url, autocommit=True) as writer:
            writer.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1, 's')")
            writer.execute(f"DELETE FROM {app}.items")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                writer.execute(
                    f"INSERT INTO {schema}.outbox (aggregate_type, aggregate_id, event_type) "
                    "VALUES ('a', 'b', 'c')"
                )
        assert [kind for _, kind, _, _ in events(db)] == ["c", "d", "tombstone"]
    finally:
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")


def test_remove_stops_the_capture_and_keeps_what_was_written(db: Connection, schema: str, app: str) -> None:
    capture(db, schema, f"{app}.items")
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1, 's')")
    with db.transaction():
        assert remove_capture(db, schema, f"{app}.items")
    with db.transaction():
        assert not remove_capture(db, schema, f"{app}.items")
    db.execute(f"INSERT INTO {app}.items VALUES (2, 'ink', 1, 's')")
    assert [key for key, _, _, _ in events(db)] == ['{"id":1}']
    assert list_captures(db, schema) == []


def test_large_values_are_whole_in_before_and_after(db: Connection, schema: str, app: str) -> None:
    capture(db, schema, f"{app}.items")
    big = "x" * 300_000  # stored out of line (TOAST), and not changed by the update
    db.execute(f"INSERT INTO {app}.items VALUES (1, %s, 1, 's')", (big,))
    db.execute(f"UPDATE {app}.items SET price = 2")
    update = events(db)[1][2]
    assert update is not None
    assert update["before"]["name"] == update["after"]["name"] == big


def test_snapshot_never_shows_a_key_going_back_under_concurrent_writers(
    servers: Servers, db: Connection, schema: str, app: str
) -> None:
    """Writers bump a version column of random rows while the snapshot reads in small chunks; a relay
    publishes. For every key, the versions a consumer reads in partition order never go back, every
    row's last event is its final version, and an interrupted snapshot resumes where it stopped."""
    rows = 600
    db.execute(f"ALTER TABLE {app}.items ADD COLUMN version integer NOT NULL DEFAULT 0")
    db.execute(f"INSERT INTO {app}.items (id, name) SELECT i, 'n' || i FROM generate_series(1, {rows}) AS i")
    topic = capture(db, schema, f"{app}.items")
    stop = threading.Event()

    def write() -> None:
        chooser = random.Random(7)
        with psycopg.connect(servers.database_url, autocommit=True) as writer:
            while not stop.is_set():
                with writer.transaction():
                    for key in sorted(chooser.sample(range(1, rows + 1), 5)):
                        writer.execute(f"UPDATE {app}.items SET version = version + 1 WHERE id = %s", (key,))

    writers = [threading.Thread(target=write) for _ in range(2)]
    for thread in writers:
        thread.start()
    try:
        # Interrupted after three chunks (as a crash would leave it: each chunk committed on its own)...
        for _ in range(3):
            with db.transaction():
                db.execute("SELECT capture_snapshot_chunk(%s::regclass, 50)", (f"{app}.items",))
        # ...then resumed to the end.
        resumed = snapshot(db, schema, f"{app}.items", chunk_rows=50)
    finally:
        stop.set()
        for thread in writers:
            thread.join()
    assert resumed == rows - 150
    [listed] = list_captures(db, schema)
    assert listed.snapshot == "done"
    final = dict(db.execute(f"SELECT id, version FROM {app}.items").fetchall())
    written = db.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema):
        records = read_topic(servers.kafka_bootstrap, topic, written, timeout=120)
    assert len(records) == written
    seen: dict[int, list[tuple[str, int]]] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert record.value is not None
        value = json.loads(record.value)
        seen.setdefault(value["after"]["id"], []).append((value["op"], value["after"]["version"]))
    assert seen.keys() == final.keys(), "every row reached the consumer"
    for key, versions in seen.items():
        numbers = [version for _, version in versions]
        assert numbers == sorted(numbers), f"key {key} went back: {versions}"
        assert numbers[-1] == final[key]
        assert sum(op == "r" for op, _ in versions) == 1, f"key {key}: one read event"


def test_capture_commands(servers: Servers, db: Connection, schema: str, app: str) -> None:
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'pen', 1, 's'), (2, 'ink', 2, 's')")
    added = postbox_cli(
        servers,
        schema,
        "capture",
        "add",
        f"{app}.items",
        "--exclude-columns",
        "secret",
        "--no-tombstones-on-delete",
    )
    assert added.returncode == 0, added.stderr
    assert f"topic postbox.{app}.items" in added.stdout
    listed = postbox_cli(servers, schema, "capture", "list")
    assert (
        f"{app}.items -> postbox.{app}.items  key=id exclude-columns=secret tombstones.on.delete=false"
        in listed.stdout
    )
    shot = postbox_cli(
        servers,
        schema,
        "capture",
        "snapshot",
        f"{app}.items",
        env={"POSTBOX_CAPTURE_SNAPSHOT_CHUNK_ROWS": "1"},
    )
    assert shot.returncode == 0, shot.stderr
    assert "snapshot done, 2 rows emitted" in shot.stdout
    assert [kind for _, kind, _, _ in events(db)] == ["r", "r"]
    refused = postbox_cli(servers, schema, "capture", "add", f"{app}.nope")
    assert refused.returncode == 2
    assert f'relation "{app}.nope" does not exist' in refused.stderr
    db.execute(f"CREATE TABLE {app}.keyless (a integer)")
    refused = postbox_cli(servers, schema, "capture", "add", f"{app}.keyless")
    assert refused.returncode == 2
    assert "has no primary key" in refused.stderr
    assert "hint: name the columns" in refused.stderr
    removed = postbox_cli(servers, schema, "capture", "remove", f"{app}.items")
    assert removed.returncode == 0
    assert "no longer captured" in removed.stdout


def test_a_projection_through_the_inbox_equals_the_table_after_relay_kills_across_replicas(
    servers: Servers, db: Connection, schema: str, app: str
) -> None:
    """Writers insert, update and delete rows of a captured table (and a snapshot reads the rows that were
    there before the capture) while two relay replicas share the shards and one of them is SIGKILLed every
    few seconds; the inbox applies the events to a replica table with the version-guarded upsert. Once the
    writers stop, the replica equals the table row for row: per key, the events arrived in commit order."""
    from tests.apps.projection import APP, SCHEMA_SQL  # noqa: PLC0415

    db.execute(SCHEMA_SQL)
    db.execute(f"ALTER TABLE {app}.items ADD COLUMN version integer NOT NULL DEFAULT 0")
    db.execute(f"INSERT INTO {app}.items (id, name) SELECT i, 'old ' || i FROM generate_series(1, 300) AS i")
    topic = capture(db, schema, f"{app}.items")
    create_topic(servers.kafka_bootstrap, topic, 4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(seed: int) -> None:
        chooser = random.Random(seed)
        try:
            with psycopg.connect(servers.database_url, autocommit=True) as writer:
                while not stop.is_set():
                    key = chooser.randrange(1, 400)
                    action = chooser.random()
                    if action < 0.6:
                        writer.execute(
                            f"INSERT INTO {app}.items (id, name) VALUES (%s, 'new') "
                            f"ON CONFLICT (id) DO UPDATE SET name = 'w{seed}', version = items.version + 1",
                            (key,),
                        )
                    elif action < 0.8:
                        writer.execute(f"DELETE FROM {app}.items WHERE id = %s", (key,))
                    else:
                        with writer.transaction():
                            writer.execute(
                                f"UPDATE {app}.items SET version = version + 1 WHERE id < %s", (key % 7,)
                            )
        except BaseException as exc:  # noqa: BLE001  (reported by the test thread below)
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(seed,)) for seed in range(2)]
    with InboxProcess(servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], log_level="info"):
        for thread in writers:
            thread.start()
        relays = [RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) for _ in range(2)]
        try:
            snapshot(db, schema, f"{app}.items", chunk_rows=40)
            for turn in range(4):  # two replicas share the shards; one of them dies mid-stream each turn
                time.sleep(4)  # the fault's period
                relays[turn % 2].kill()
                relays[turn % 2] = RelayProcess(servers.database_url, servers.kafka_bootstrap, schema)
        finally:
            for relay in relays:
                relay.kill()
            stop.set()
            for thread in writers:
                thread.join()
        assert not errors, errors
        source = f"SELECT id, name, version FROM {app}.items ORDER BY id"
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema):
            wait_until(
                lambda: (
                    db.execute(source).fetchall()
                    == db.execute("SELECT id, name, version FROM replica ORDER BY id").fetchall()
                ),
                120,
                interval=0.5,
                what="the replica to equal the table",
            )
    assert db.execute("SELECT count(*) FROM replica").fetchone()[0] > 0  # type: ignore[index]


def test_captures_survive_mode_switches_and_migrate(
    servers: Servers, db: Connection, schema: str, app: str
) -> None:
    """A capture writes rows in the state of the outbox's mode, whatever it is when the writer commits,
    and `postbox migrate` (already current, or upgrading) keeps it."""
    from postbox.relay.core.migrate import migrate  # noqa: PLC0415
    from postbox.relay.outbox.admin import switch_mode  # noqa: PLC0415

    topic = capture(db, schema, f"{app}.items")
    db.execute(f"INSERT INTO {app}.items VALUES (1, 'log', 1, 's')")
    switch_mode(db, schema, "queue")
    db.execute(f"INSERT INTO {app}.items VALUES (2, 'queue', 1, 's')")
    switch_mode(db, schema, "log")
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        assert migrate(conn, schema) == []
    db.execute(f"INSERT INTO {app}.items VALUES (3, 'log again', 1, 's')")
    states = db.execute("SELECT aggregate_id, state FROM outbox ORDER BY id").fetchall()
    # The first log, unread when the outbox went back to log mode, was queued at that switch.
    assert states == [('{"id":1}', "pending"), ('{"id":2}', "pending"), ('{"id":3}', "logged")]
    assert [c.table for c in list_captures(db, schema)] == [f"{app}.items"]
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema):
        records = read_topic(servers.kafka_bootstrap, topic, 3)
    assert sorted(json.loads(r.value)["after"]["name"] for r in records if r.value) == [
        "log",
        "log again",
        "queue",
    ]
