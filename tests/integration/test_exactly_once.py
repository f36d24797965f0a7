"""Exactly-once publication (--exactly-once) on the real servers: a read_committed consumer sees every
event once, in per-aggregate order, through relays killed mid-transaction, a broker restart, a lease
moving between replicas, a database commit lost after its Kafka commit, and a row the broker refuses."""

from __future__ import annotations

import random
import secrets
import time
import uuid
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from postbox.relay.core.db import connect
from postbox.relay.outbox import OutboxEvent, enqueue_many
from postbox.relay.outbox.exactly_once.groups import GROUP_COUNT, group_of, shards_of
from postbox.relay.outbox.exactly_once.settlement import Settlement
from postbox.relay.outbox.exactly_once.write_back import ForeignSettlement, outbox_identity, write_back
from postbox.relay.outbox.outcome import RowOutcome, RowState
from postbox.relay.outbox.sources.log_cursors import Cursor, CursorMove
from postbox.relay.outbox.sources.queue import Claimer
from tests.chaos.checker import check
from tests.support.database import outbox_states, shard_owners
from tests.support.delivery import sequenced_writers
from tests.support.kafka import create_topic, read_topic
from tests.support.modes import LOG_ONLY, QUEUE_ONLY
from tests.support.probes import http_get, metric_value
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]
EXACTLY_ONCE = ("--exactly-once", "--delivery-timeout", "6")


def _write(database_url: str, schema: str, events: list[OutboxEvent]) -> dict[str, tuple[str, int]]:
    with psycopg.connect(database_url) as app:
        ids = enqueue_many(app, events, schema=schema)
        app.commit()
    return {str(i): (e.aggregate_id, int(e.payload["seq"])) for i, e in zip(ids, events, strict=True)}


def _metrics(relay: RelayProcess) -> str:
    return http_get(relay.metrics_port, "/metrics")[1]


def _assert_exactly_once(records: list[Any], written: dict[str, tuple[str, int]]) -> None:
    report = check(written, records)
    assert report.ok, "\n".join([*report.lines(), f"lost e.g. {report.lost[:3]}"])
    assert report.duplicates == 0, "\n".join(report.lines())


@LOG_ONLY
def test_each_batch_is_a_transaction_and_a_read_committed_consumer_sees_every_event_once(
    servers: Servers, schema: str
) -> None:
    aggregate_type = f"eo{uuid.uuid4().hex[:6]}"
    events = [OutboxEvent(aggregate_type, f"a{i % 7}", "Changed", {"seq": i // 7}) for i in range(300)]
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, *EXACTLY_ONCE) as relay:
        wait_until(lambda: http_get(relay.metrics_port, "/readyz")[0] == 200, 60, what="ready")
        written = _write(servers.database_url, schema, events)
        wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 300}, 60)
        metrics = _metrics(relay)
        assert relay.terminate() == 0
    assert metric_value(metrics, "postbox_relay_transactions_total", ending="committed") >= 1
    assert metric_value(metrics, "postbox_relay_exactly_once_groups_ready") == GROUP_COUNT
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=300)
    _assert_exactly_once(records, written)
    # Every settlement went to the group's own partition of the compacted cursor topic.
    with psycopg.connect(servers.database_url) as conn:
        found = conn.execute(f'SELECT outbox_id::text FROM "{schema}".outbox_identity').fetchone()
    assert found is not None
    cursor_topic = f"postbox.{schema}.{str(found[0])[:8]}.cursors"  # the default prefix names the outbox
    settlements = read_topic(servers.kafka_bootstrap, cursor_topic, expected=1, settle=2)
    assert settlements
    assert {r.partition for r in settlements} == {int(r.key or b"-1") for r in settlements}


@LOG_ONLY
def test_a_database_commit_lost_after_its_kafka_commit_is_written_back_and_nothing_is_sent_twice(
    servers: Servers, schema: str, db: Conn
) -> None:
    """The one window exactly-once must close: the batch's Kafka transaction committed, then the relay's
    database session dies before the cursor moves. A trigger ends the session at the first cursor update
    that passes a marker row (only the batch that published it does that: no empty-window move can pass
    a row of its shard). The relay reconnects, reads the group's last settlement back and writes it: the
    batch is not published again."""
    aggregate_type = f"eolost{uuid.uuid4().hex[:6]}"
    db.execute(
        f"""
        CREATE SEQUENCE cut_once;
        CREATE FUNCTION passes(c outbox_cursor, x_id bigint, x_txid xid8) RETURNS boolean LANGUAGE sql AS $$
            SELECT coalesce(pg_visible_in_snapshot(x_txid,
                       (SELECT snapshot FROM "{schema}".outbox_tick WHERE tick = c.tick)), false)
                OR (c.window_to IS NOT NULL AND x_id <= c.last_id
                    AND coalesce(pg_visible_in_snapshot(x_txid,
                       (SELECT snapshot FROM "{schema}".outbox_tick WHERE tick = c.window_to)), false))
        $$;
        CREATE FUNCTION cut_after_kafka() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE x record;
        BEGIN
            SELECT id, txid, shard INTO x FROM "{schema}".outbox WHERE aggregate_id = 'marker';
            IF FOUND AND NEW.shard = x.shard AND "{schema}".passes(NEW, x.id, x.txid)
               AND NOT "{schema}".passes(OLD, x.id, x.txid)
               AND nextval('"{schema}".cut_once') = 1 THEN
                PERFORM pg_terminate_backend(pg_backend_pid());
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER cut BEFORE UPDATE ON outbox_cursor FOR EACH ROW EXECUTE FUNCTION cut_after_kafka();
        """
    )
    db.commit()
    events = [OutboxEvent(aggregate_type, f"a{i % 5}", "Changed", {"seq": i // 5}) for i in range(50)]
    events.append(OutboxEvent(aggregate_type, "marker", "Changed", {"seq": 0}))
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, *EXACTLY_ONCE) as relay:
        wait_until(lambda: http_get(relay.metrics_port, "/readyz")[0] == 200, 60, what="ready")
        written = _write(servers.database_url, schema, events)
        wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 51}, 60)
        # Two updates passed the marker: the one the trigger cut, then the write-back (or, were there none,
        # the batch read and published again).
        assert db.execute("SELECT last_value FROM cut_once").fetchone() == (2,)
        log = relay.log()
        assert "relay_settlement_written_back" in log
        assert relay.terminate() == 0
    for isolation in ("read_committed", "read_uncommitted"):
        records = read_topic(
            servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=51, isolation=isolation
        )
        _assert_exactly_once(records, written)


@LOG_ONLY
def test_a_settlement_is_written_back_only_where_the_database_lacks_it(
    servers: Servers, schema: str, db: Conn
) -> None:
    """write_back on the real database: nothing while this relay does not lease every shard of the group;
    then a cursor moves only if it still stands where the batch found it, with the rows parked in it; a
    claimed row is marked published only if still pending, and one the batch parked is left pending (it
    was not sent; parking it again would undo a requeue); a settlement of another copy of this outbox is
    ignored, and one of another outbox is a configuration error."""
    events = [OutboxEvent("wb", f"a{i}", "X", {"seq": 0}) for i in range(40)]
    ids = list(_write(servers.database_url, schema, events))
    rows = [
        (int(str(i)), int(str(s)))
        for i, s in db.execute(
            "SELECT id, shard FROM outbox WHERE event_id = ANY(%s::uuid[]) ORDER BY id", (ids,)
        )
    ]
    logged_id, logged_shard = rows[0]
    group = group_of(logged_shard)
    in_group = [(i, s) for i, s in rows[1:] if group_of(s) == group]
    (published_id, _), (refused_id, _) = in_group[0], in_group[1]  # claimed rows: pending
    for row_id in (published_id, refused_id):
        db.execute("UPDATE outbox SET state = 'failed' WHERE id = %s", (row_id,))
        db.execute("UPDATE outbox SET state = 'pending' WHERE id = %s", (row_id,))  # as requeue does
    stale_shard = next(s for s in shards_of(group) if s != logged_shard)
    ticks = {int(str(s)): int(str(t)) for s, t in db.execute("SELECT shard, tick FROM outbox_cursor")}
    db.commit()
    here = Cursor(logged_shard, ticks[logged_shard])
    ahead = Cursor(logged_shard, here.tick, here.tick + 1, logged_id, logged_id)
    stale = Cursor(stale_shard, ticks[stale_shard] - 1)  # where it stood: it moved on since
    claimer = Claimer("wb-relay", 1, delete_on_publish=False)

    def lease(shards: list[int]) -> None:
        db.execute(
            "UPDATE outbox_shard_lease SET owner = 'wb-relay', expires_at = now() + interval '1 hour' "
            "WHERE shard = ANY(%s)",
            (shards,),
        )
        db.commit()

    def cursors() -> dict[int, tuple[object, ...]]:
        found = db.execute("SELECT shard, tick, window_to, last_id, max_id FROM outbox_cursor").fetchall()
        db.commit()
        return {int(str(r[0])): tuple(r[1:]) for r in found}

    def states() -> dict[int, str]:
        found = db.execute(
            "SELECT id, state FROM outbox WHERE id = ANY(%s)", ([logged_id, published_id, refused_id],)
        )
        result = {int(str(i)): str(s) for i, s in found}
        db.commit()
        return result

    before = (cursors(), states())
    with connect(servers.database_url, schema, autocommit=True) as conn:
        identity = outbox_identity(conn)
        settlement = Settlement(
            group,
            "earlier-owner",
            identity,
            moves=(
                CursorMove(logged_shard, here, ahead),
                CursorMove(stale_shard, stale, replace(stale, window_to=stale.tick + 1, last_id=1, max_id=1)),
            ),
            parked=(RowOutcome(logged_id, RowState.FAILED, "refused"),),
            marked=(
                RowOutcome(published_id, RowState.PUBLISHED, None),
                RowOutcome(refused_id, RowState.FAILED, "refused"),
            ),
        )
        lease(shards_of(group)[:-1])
        assert not write_back(conn, claimer, settlement), "a shard of the group is not leased here"
        assert (cursors(), states()) == before
        lease(shards_of(group))
        with pytest.raises(ForeignSettlement, match="--transactional-id-prefix"):
            write_back(conn, claimer, replace(settlement, outbox="another-outbox/1"))
        copy = f"{identity.partition('/')[0]}/1"  # this outbox's id, another copy's cursor table
        assert write_back(conn, claimer, replace(settlement, outbox=copy))
        assert (cursors(), states()) == before
        assert write_back(conn, claimer, settlement)
        after = (cursors(), states())
        assert write_back(conn, claimer, settlement)  # again: nothing more changes
        assert (cursors(), states()) == after
    found, rows_now = after
    assert found[logged_shard] == (ahead.tick, ahead.window_to, ahead.last_id, ahead.max_id)
    assert found[stale_shard] == before[0][stale_shard]
    assert rows_now == {logged_id: "failed", published_id: "published", refused_id: "pending"}


@LOG_ONLY
def test_a_row_the_broker_refuses_aborts_its_transaction_and_is_parked_and_the_rest_is_sent_once(
    servers: Servers, schema: str
) -> None:
    """The topic takes at most 1,500 bytes a message, under the producer's limit: only the broker can
    refuse the big row (random, so that compression cannot shrink it), inside the transaction. It answers
    for the whole request, the row's neighbours on its partition with it: the transaction is aborted
    (nothing of it reaches read_committed consumers), each refused row is tried alone, and only the big
    one is parked; its neighbours, an aggregate's earlier and later events among them, go out once."""
    aggregate_type = f"eobig{uuid.uuid4().hex[:6]}"
    topic = f"outbox.event.{aggregate_type}"
    create_topic(servers.kafka_bootstrap, topic, 3, config={"max.message.bytes": "1500"})
    events = [OutboxEvent(aggregate_type, f"a{i % 4}", "Changed", {"seq": i // 4}) for i in range(20)]
    events.insert(
        10, OutboxEvent(aggregate_type, "a2", "Changed", {"seq": 0, "blob": secrets.token_urlsafe(4000)})
    )
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, *EXACTLY_ONCE) as relay:
        wait_until(lambda: http_get(relay.metrics_port, "/readyz")[0] == 200, 60, what="ready")
        written = _write(servers.database_url, schema, events)
        wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 20, "failed": 1}, 60)
        metrics = _metrics(relay)
        assert relay.terminate() == 0
    assert metric_value(metrics, "postbox_relay_transactions_total", ending="aborted") >= 1
    big = list(written)[10]
    del written[big]
    _assert_exactly_once(read_topic(servers.kafka_bootstrap, topic, expected=20), written)


@LOG_ONLY
@pytest.mark.timeout(420)
def test_three_relays_killed_under_writes_then_a_broker_restart_and_a_lease_move_send_each_event_once(
    servers: Servers, schema: str, own_kafka: Any
) -> None:
    aggregate_type = f"eochaos{uuid.uuid4().hex[:6]}"
    topic = f"outbox.event.{aggregate_type}"
    create_topic(own_kafka.bootstrap, topic, 6)
    written: dict[str, tuple[str, int]] = {}
    rng = random.Random(20261207)

    def relay() -> RelayProcess:
        return RelayProcess(
            servers.database_url, own_kafka.bootstrap, schema, *EXACTLY_ONCE, "--batch-size", "50"
        )

    relays = [relay() for _ in range(3)]
    writers = sequenced_writers(
        servers.database_url, schema, aggregate_type, written, events_per_aggregate=60, pause=0.05
    )
    kills = 0
    try:
        for writer in writers:
            writer.start()
        while any(w.is_alive() for w in writers) or kills < 4:
            time.sleep(rng.uniform(1.5, 3.0))  # pacing, not waiting: kills land anywhere in the loop
            index = rng.randrange(len(relays))
            relays[index].kill()
            relays[index].__exit__()
            relays[index] = relay()
            kills += 1
        for writer in writers:
            writer.join(timeout=120)
        own_kafka.stop_node(own_kafka.nodes[0], kill=True)
        time.sleep(2)  # pacing: the relays meet a dead broker mid-stream
        own_kafka.start_node(own_kafka.nodes[0])
        # A lease move: one replica stops cleanly, its groups go to the others; a new one joins.
        assert relays[0].terminate() == 0
        relays[0].__exit__()
        relays[0] = relay()
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": len(written)},
            180,
            what=f"all {len(written)} rows published",
        )
        wait_until(
            lambda: len(shard_owners(servers.database_url, schema)) == 3, 60, what="three owners again"
        )
        owners = shard_owners(servers.database_url, schema)
        assert all(count % 8 == 0 for count in owners.values()), f"whole groups only: {owners}"
        assert [r.terminate() for r in relays] == [0, 0, 0]
    finally:
        for process in relays:
            process.__exit__()
    assert len(written) == 1800
    records = read_topic(own_kafka.bootstrap, topic, expected=len(written), timeout=120, settle=3)
    _assert_exactly_once(records, written)


@QUEUE_ONLY
def test_a_relay_asked_for_exactly_once_on_a_queue_mode_outbox_refuses_to_start(
    servers: Servers, schema: str
) -> None:
    """(QUEUE_ONLY: the outbox is in queue mode.) --mode auto follows the outbox to queue mode, where no
    transaction can hold the marks: the relay says so and exits 2."""
    relay = RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--exactly-once")
    try:
        assert relay.process.wait(timeout=60) == 2
        assert "--exactly-once needs log mode" in relay.log()
    finally:
        relay.__exit__()
