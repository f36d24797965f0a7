"""Log mode on the real servers: what reading the outbox in commit order between snapshots must get right,
and switching an outbox between the modes. The behaviour it shares with queue mode (delivery, killed
relays, a PostgreSQL crash, a paused replica, a late commit, a parked row, three replicas) runs in both modes
in test_relay_delivery.py and test_relay_faults.py, the soak and the Debezium comparison likewise.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from postbox.relay.core.db import advisory_key, connect
from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_many
from postbox.relay.outbox.admin import SwitchRefused, log_progress, prune, requeue, switch_mode
from tests.support.database import newest_tick, outbox_states
from tests.support.delivery import check_delivery
from tests.support.kafka import read_topic
from tests.support.modes import LOG_ONLY, QUEUE_ONLY
from tests.support.probes import http_get
from tests.support.processes import RelayProcess, followed_modes
from tests.support.servers import Servers
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]


def _write(database_url: str, schema: str, events: list[OutboxEvent]) -> list[str]:
    with psycopg.connect(database_url) as app:
        ids = [str(i) for i in enqueue_many(app, events, schema=schema)]
        app.commit()
    return ids


def _events(aggregate_type: str, count: int, start: int = 0) -> list[OutboxEvent]:
    return [
        OutboxEvent(aggregate_type, f"a{i % 5}", "Changed", {"seq": i}) for i in range(start, start + count)
    ]


@LOG_ONLY
def test_rows_stay_unwritten_and_a_long_transaction_elsewhere_delays_nothing(
    servers: Servers, schema: str, db: Conn
) -> None:
    """A transaction that holds an id and stays open (writing another table) is in every snapshot's
    in-progress list; rows committed meanwhile are published within moments all the same, and the relay
    writes nothing to them."""
    aggregate_type = f"longtx{uuid.uuid4().hex[:6]}"
    db.execute("CREATE TABLE scratch (n int)")
    long_tx = psycopg.connect(servers.database_url)
    long_tx.execute(f'INSERT INTO "{schema}".scratch VALUES (1)')  # takes a transaction id, stays open
    try:
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
            tick = newest_tick(servers.database_url, schema)
            wait_until(
                lambda: newest_tick(servers.database_url, schema) >= tick + 3,
                20,
                what="the relay reading on, three ticks with the transaction open",
            )
            committed_at = time.monotonic()
            ids = _write(servers.database_url, schema, _events(aggregate_type, 30))
            wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 30}, 10)
            waited = time.monotonic() - committed_at
            records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=30)
            assert relay.terminate() == 0
    finally:
        long_tx.rollback()
        long_tx.close()
    assert waited < 5, f"published {waited:.1f} s after commit while another transaction stayed open"
    assert sorted(r.headers["id"].decode() for r in records) == sorted(ids)
    rows = db.execute("SELECT state, attempts, published_at FROM outbox GROUP BY 1, 2, 3").fetchall()
    assert rows == [("logged", 0, None)], "log mode writes nothing to a published row"


@LOG_ONLY
def test_rolled_back_rows_and_sequence_gaps_are_skipped_and_a_prepared_transaction_is_published_on_commit(
    servers: Servers, schema: str, db: Conn
) -> None:
    aggregate_type = f"gaps{uuid.uuid4().hex[:6]}"
    # PostgreSQL refuses to PREPARE a transaction that sent a NOTIFY: writers that use two-phase commit
    # turn the wake-up trigger off (as docs/explanation/log-mode.md says) and the relay finds their rows
    # by polling.
    db.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
    with psycopg.connect(servers.database_url) as app:
        enqueue_many(app, _events(aggregate_type, 5), schema=schema)
        app.rollback()  # ids taken and never committed: a gap in the sequence
    prepared = psycopg.connect(servers.database_url, autocommit=True)
    prepared.execute("BEGIN")
    prepared_ids = [
        str(i) for i in enqueue_many(prepared, _events(aggregate_type, 3, start=100), schema=schema)
    ]
    gid = f"postbox-test-{uuid.uuid4().hex[:8]}"
    prepared.execute(f"PREPARE TRANSACTION '{gid}'")  # survives its session; commits minutes later
    prepared.close()
    try:
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
            ids = _write(servers.database_url, schema, _events(aggregate_type, 10, start=10))
            wait_until(
                lambda: outbox_states(servers.database_url, schema) == {"published": 10},
                20,
                what="the committed rows, past the gap and the prepared transaction",
            )
            tick = newest_tick(servers.database_url, schema)
            wait_until(
                lambda: newest_tick(servers.database_url, schema) >= tick + 3,
                10,
                what="several ticks with the prepared transaction in progress",
            )
            with psycopg.connect(servers.database_url, autocommit=True) as admin:
                admin.execute(f"COMMIT PREPARED '{gid}'")
            gid = ""
            wait_until(
                lambda: outbox_states(servers.database_url, schema) == {"published": 13},
                20,
                what="the prepared transaction's rows",
            )
            assert relay.terminate() == 0
    finally:
        if gid:
            with psycopg.connect(servers.database_url, autocommit=True) as admin:
                admin.execute(f"ROLLBACK PREPARED '{gid}'")
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=13)
    assert sorted(r.headers["id"].decode() for r in records) == sorted(ids + prepared_ids)


@LOG_ONLY
def test_a_parked_row_is_requeued_with_its_event_id_and_published(
    servers: Servers, schema: str, db: Conn
) -> None:
    aggregate_type = f"park{uuid.uuid4().hex[:6]}"
    with psycopg.connect(servers.database_url) as app:
        big = str(enqueue(app, aggregate_type, "a0", "Huge", {"blob": "x" * 2_000_000}, schema=schema))
        app.commit()
    ids = _write(servers.database_url, schema, _events(aggregate_type, 5))
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 5, "failed": 1}, 20)
        db.execute('UPDATE outbox SET payload = \'{"blob": "small now"}\' WHERE event_id = %s', (big,))
        with connect(servers.database_url, schema) as conn:
            assert len(requeue(conn, error_like="%too large%")) == 1
        wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 6}, 20)
        assert relay.terminate() == 0
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=6)
    assert sorted(r.headers["id"].decode() for r in records) == sorted([*ids, big])


@LOG_ONLY
def test_a_replica_stopped_while_taking_a_tick_is_fenced_and_holds_no_one_up(
    servers: Servers, schema: str, db: Conn
) -> None:
    """A replica stopped between the tick lock and its commit (found by the paused-replica fault test)
    holds the tick lock until its sessions end. A relay must not wait for that lock: a lane waiting there
    held up the lease tick that ends the stopped replica's sessions, so nothing moved until the server's
    idle timeout. Here a session named like a replica, heartbeating no more, holds the lock for good."""
    aggregate_type = f"ticklock{uuid.uuid4().hex[:6]}"
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    db.execute(
        "INSERT INTO outbox_relay_member (relay_id, last_seen, backend_pid) "
        "VALUES (%s, clock_timestamp(), 0)",
        (ghost,),
    )
    holder = psycopg.connect(servers.database_url, application_name=f"postbox-relay {ghost}")
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_key("postbox.tick", schema),))
    try:
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
            ids = _write(servers.database_url, schema, _events(aggregate_type, 30))
            wait_until(lambda: outbox_states(servers.database_url, schema) == {"published": 30}, 20)
            records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=30)
            assert relay.terminate() == 0
    finally:
        holder.close()
    assert "relay_expired_member_fenced" in relay.log(), "the stopped replica's sessions were ended"
    assert sorted(r.headers["id"].decode() for r in records) == sorted(ids)


@LOG_ONLY
def test_a_queue_relay_refuses_a_log_mode_outbox(servers: Servers, schema: str) -> None:
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--mode", "queue") as relay:
        assert relay.process.wait(timeout=30) == 2
        assert "switch-mode" in relay.log()


@QUEUE_ONLY  # an outbox never switched to log mode: a queue-mode one
def test_a_log_relay_refuses_an_outbox_never_switched(servers: Servers, schema: str) -> None:
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--mode", "log") as relay:
        assert relay.process.wait(timeout=30) == 2
        assert "switch-mode log" in relay.log()


@LOG_ONLY
def test_finished_partitions_are_emptied_whole_and_no_unread_open_or_parked_row_is_lost(
    servers: Servers, schema: str, db: Conn
) -> None:
    """Retention in log mode empties whole partitions of txids (no row deletes). A partition is emptied
    only once no transaction that could write to it is open and every shard's cursor has read past it; a
    parked row in it moves to outbox_parked first and can still be requeued."""
    url, bootstrap = servers.database_url, servers.kafka_bootstrap
    aggregate_type = f"part{uuid.uuid4().hex[:6]}"

    def burn(xids: int) -> None:  # transactions that take an id and write nothing: txids move on
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(xids):
                conn.execute("SELECT pg_current_xact_id()")

    def prune_now() -> int:
        with connect(url, schema) as conn:
            return prune(conn, retention=timedelta(0)).partitions.emptied

    def left(event_ids: list[str]) -> set[str]:
        found = db.execute("SELECT event_id::text FROM outbox WHERE event_id::text = ANY (%s)", (event_ids,))
        return {str(r[0]) for r in found}

    def ranged_partitions() -> int:
        found = db.execute("SELECT count(*) FROM outbox_partition WHERE xid_to IS NOT NULL").fetchone()
        return int(str(found[0])) if found else 0

    written = _write(url, schema, _events(aggregate_type, 10))  # before any relay: the default partition
    parked = db.execute(
        "UPDATE outbox SET state = 'failed', last_error = 'parked for the test' WHERE event_id = %s "
        "RETURNING id",
        (written[0],),
    ).fetchone()
    assert parked is not None
    parked_id = int(str(parked[0]))
    prune_now()
    assert left(written) == set(written), "unread rows stay"

    with RelayProcess(url, bootstrap, schema, "--partition-xids", "64") as relay:
        wait_until(lambda: outbox_states(url, schema) == {"published": 9, "failed": 1}, 30)
        wait_until(lambda: ranged_partitions() >= 2, 10, what="partitions created ahead")
        holder = psycopg.connect(url)  # an open transaction that holds an outbox row
        held = str(enqueue(holder, aggregate_type, "held", "Changed", {"seq": -1}, schema=schema))
        found = holder.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        assert found is not None
        held_txid = int(str(found[0]))
        try:
            after_held: list[str] = []
            for round_ in range(4):  # rows in several partitions, past the open transaction's
                burn(64)
                after_held += _write(url, schema, _events(aggregate_type, 10, start=10 + 10 * round_))
            wait_until(lambda: outbox_states(url, schema) == {"published": 49, "failed": 1}, 30)
            # Pruning may empty what is published (the rows after it, wherever no unread row or open
            # writer holds their partition back), never the open transaction's own row.
            emptied = sum(prune_now() for _ in range(3))
            own = holder.execute(
                f'SELECT txid::text::bigint FROM "{schema}".outbox WHERE event_id = %s', (held,)
            )
            assert own.fetchone() == (held_txid,), "the open transaction's row is still there"
            holder.commit()
        finally:
            holder.close()
        written += after_held
        published = len(written) - 1 + 1  # the parked row not, the held row since its commit
        read_topic(bootstrap, f"outbox.event.{aggregate_type}", expected=published)

        burn(200)
        last = _write(url, schema, _events(aggregate_type, 5, start=100))  # new ticks; cursors move on
        wait_until(lambda: outbox_states(url, schema).get("pending", 0) == 0, 30, what="last rows read")
        everything_before_last = [*written, held]

        def emptied_all_but_the_parked_row() -> bool:
            nonlocal emptied
            emptied += prune_now()
            return left(everything_before_last) == {written[0]}

        wait_until(emptied_all_but_the_parked_row, 30, what="finished partitions emptied")
        assert emptied >= 3
        # A drop waits at most 50 ms for the outbox's lock (writers queue behind it), so one that meets a
        # relay's statement gives up until the next pruning run, as the daemon's next run would retry it.
        wait_until(
            lambda: prune_now() >= 0 and ranged_partitions() <= 4, 30, what="emptied partitions are dropped"
        )
        assert db.execute("SELECT to_regclass('outbox_p0')").fetchone() == (None,)
        moved = db.execute("SELECT state, tableoid::regclass::text FROM outbox WHERE id = %s", (parked_id,))
        assert moved.fetchone() == ("failed", "outbox_parked"), "the parked row is kept apart"

        _, metrics = http_get(relay.metrics_port, "/metrics")  # the partitions' gauge, both states
        assert 'postbox_relay_outbox_partitions{state="finished"}' in metrics
        assert 'postbox_relay_outbox_partitions{state="in_use"}' in metrics

        assert requeue(db, ids=[parked_id]) == [parked_id]
        records = read_topic(bootstrap, f"outbox.event.{aggregate_type}", expected=len(written) + 1 + 5)
        assert relay.terminate() == 0
    assert sorted(r.headers["id"].decode() for r in records) == sorted([*written, held, *last])
    counts = db.execute(
        "SELECT count(*), count(done_at) FROM outbox_partition "
        "WHERE xid_to IS NOT NULL AND emptied_at IS NULL"
    ).fetchone()
    assert counts is not None
    assert f"partitions         {counts[0]}, {counts[1]} finished" in _status(servers, schema)


def _status(servers: Servers, schema: str) -> str:
    command = [sys.executable, "-m", "postbox", "relay", "status", "--database-url", servers.database_url]
    return subprocess.run([*command, "--schema", schema], capture_output=True, text=True, check=True).stdout


def _write_continuously(
    database_url: str,
    schema: str,
    aggregate_type: str,
    stop: threading.Event,
    written: dict[str, tuple[str, int]],
) -> None:
    seq = dict.fromkeys((f"s{i}" for i in range(8)), 0)
    with psycopg.connect(database_url) as app:
        while not stop.is_set():
            batch = []
            for aggregate in list(seq)[: 1 + len(written) % 3]:
                batch.append(OutboxEvent(aggregate_type, aggregate, "Changed", {"seq": seq[aggregate]}))
                seq[aggregate] += 1
            for event_id, event in zip(enqueue_many(app, batch, schema=schema), batch, strict=True):
                written[str(event_id)] = (event.aggregate_id, event.payload["seq"])
            app.commit()
            time.sleep(0.005)  # pacing, not waiting: a steady stream of small transactions


@QUEUE_ONLY  # the procedure starts from an outbox in queue mode
@pytest.mark.parametrize("relays", ["pinned", "auto"])
def test_switching_queue_to_log_and_back_under_writes_loses_nothing_and_keeps_order(
    servers: Servers, schema: str, relays: str
) -> None:
    """The documented procedure (docs/how-to/switch-to-log-mode.md), with writers running throughout: stop the
    relays, switch the outbox, start them in the new mode (pinned: --mode set to it; auto: the same relays,
    which follow the outbox). Rows pending from before the switch to log mode are claimed before the log is
    read; after the switch back, the log is read to the switch before any pending row is claimed: a relay
    pinned to queue mode refuses to start until it is; one in auto mode reads it in log mode, then goes on in
    queue mode. Per-aggregate order holds throughout."""
    aggregate_type = f"switch{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    stop = threading.Event()
    writer = threading.Thread(
        target=_write_continuously, args=(servers.database_url, schema, aggregate_type, stop, written)
    )
    url, bootstrap = servers.database_url, servers.kafka_bootstrap
    pinned = relays == "pinned"

    def relay(mode: str) -> RelayProcess:
        # Small batches and a slow poll: a backlog of both kinds builds up across each switch.
        return RelayProcess(
            url, bootstrap, schema, "--mode", mode if pinned else "auto", "--batch-size", "10"
        )

    def ran_in(relay: RelayProcess, *modes: str) -> None:
        if not pinned:
            assert followed_modes(relay) == list(modes)

    def switch(mode: str) -> None:
        with connect(url, schema) as conn:
            switch_mode(conn, schema, mode)

    def in_state(state: str) -> int:
        return rows_in_state(url, schema, state)

    def more(count: Callable[[], int], by: int, what: str) -> None:
        """Wait until count() has grown by `by` from now."""
        start = count()
        wait_until(lambda: count() >= start + by, 30, what=what)

    writer.start()
    try:
        with relay("queue") as queue_relay:
            more(lambda: in_state("published"), 50, "rows published by the queue relay")
            assert queue_relay.terminate() == 0
        ran_in(queue_relay, "queue")
        more(lambda: in_state("pending"), 20, "pending rows piling up")
        switch("log")
        with relay("log") as log_relay:
            wait_until(lambda: in_state("pending") == 0, 30, what="the pending rows claimed first")
            more(lambda: logged_rows_read(url, schema), 50, "logged rows read")
            assert log_relay.terminate() == 0
        ran_in(log_relay, "log")
        more(lambda: logged_rows_unread(url, schema), 20, "logged rows piling up")
        switch("queue")
        if pinned:
            with relay("queue") as early:
                assert early.process.wait(timeout=30) == 2, "a queue relay refuses while the log is unread"
                assert "not read to the switch" in early.log()
        with relay("log") as log_relay:
            wait_until(lambda: shards_behind_switch(url, schema) == 0, 30, what="the log read to the switch")
            assert logged_rows_unread(url, schema) == 0
            if not pinned:  # goes on in queue mode, as a restart would
                wait_until(lambda: followed_modes(log_relay) == ["log", "queue"], 10, what="queue mode")
                more(lambda: in_state("published"), 10, "a batch or two as a queue relay")
            assert log_relay.terminate() == 0
        ran_in(log_relay, "log", "queue")
        with relay("queue") as back:
            more(lambda: in_state("published"), 10, "rows published by the queue relay")
            stop.set()
            writer.join(timeout=30)
            wait_until(lambda: set(outbox_states(url, schema)) == {"published"}, 30, what="all published")
            assert back.terminate() == 0
        ran_in(back, "queue")
    finally:
        stop.set()
        writer.join(timeout=30)
    states = outbox_states(url, schema)
    assert states == {"published": len(written)}
    records = read_topic(bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


@LOG_ONLY  # starts in log mode, as a new outbox does
def test_a_log_left_unread_at_a_switch_to_queue_is_not_lost_when_switching_back(
    servers: Servers, schema: str
) -> None:
    """Log mode, queue mode, log mode again, with no relay running in between: the first log, which no
    relay read, would lie behind the cursors the second switch starts. Its rows go to the queue at that
    switch and are claimed first; nothing is lost and per-aggregate order holds."""
    aggregate_type = f"relog{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    aggregates = [f"a{i}" for i in range(8)]

    def write(period: int) -> None:
        with psycopg.connect(servers.database_url) as conn:
            for seq in range(period * 5, period * 5 + 5):
                for aggregate in aggregates:
                    event_id = enqueue(
                        conn, aggregate_type, aggregate, "Changed", {"seq": seq}, schema=schema
                    )
                    written[str(event_id)] = (aggregate, seq)
                conn.commit()

    def switch(mode: str) -> None:
        with connect(servers.database_url, schema) as conn:
            switch_mode(conn, schema, mode)

    write(0)  # logged
    switch("queue")
    write(1)  # pending
    switch("log")
    write(2)  # logged
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema):
        records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
        wait_until(
            lambda: set(outbox_states(servers.database_url, schema)) == {"published"},
            30,
            what="all published",
        )
    check_delivery(records, written)


def shards_behind_switch(database_url: str, schema: str) -> int:
    with connect(database_url, schema, autocommit=True) as conn:
        return log_progress(conn).shards_behind_switch


@QUEUE_ONLY  # a switch from queue mode to log mode
def test_a_switch_while_relays_sit_idle_is_followed_in_auto_and_stops_a_relay_pinned_to_the_old_mode(
    servers: Servers, schema: str
) -> None:
    """A switch waits only for open batches, so it can happen under running relays that have nothing to
    do. They look at the outbox's mode at every lease renewal: one in auto mode follows it, one pinned to
    queue mode (which would never read the log) stops with exit 2 and says why, and nothing is lost."""
    aggregate_type = f"idle{uuid.uuid4().hex[:6]}"
    url, bootstrap = servers.database_url, servers.kafka_bootstrap
    with (
        RelayProcess(url, bootstrap, schema, "--mode", "auto") as follower,
        RelayProcess(url, bootstrap, schema, "--mode", "queue") as pinned,
    ):
        before = _write(url, schema, _events(aggregate_type, 10))
        wait_until(
            lambda: outbox_states(url, schema) == {"published": 10}, 20, what="published in queue mode"
        )
        with connect(url, schema) as conn:
            switch_mode(conn, schema, "log")
        assert pinned.process.wait(timeout=20) == 2, "the pinned queue relay stops"
        assert "the outbox is in log mode" in pinned.log()
        wait_until(lambda: followed_modes(follower) == ["queue", "log"], 20, what="the auto relay follows")
        after = _write(url, schema, _events(aggregate_type, 10, start=10))
        wait_until(lambda: outbox_states(url, schema) == {"published": 20}, 20, what="published in log mode")
        records = read_topic(bootstrap, f"outbox.event.{aggregate_type}", expected=20)
        assert follower.terminate() == 0
    assert sorted({r.headers["id"].decode() for r in records}) == sorted(before + after)
    with connect(url, schema, autocommit=True) as conn:
        states = dict(conn.execute("SELECT state, count(*) FROM outbox GROUP BY 1").fetchall())
    assert states == {"published": 10, "logged": 10}, "the later rows were read as a log"


def logged_rows_unread(database_url: str, schema: str) -> int:
    return _logged_rows(database_url, schema, read=False)


def logged_rows_read(database_url: str, schema: str) -> int:
    return _logged_rows(database_url, schema, read=True)


def _logged_rows(database_url: str, schema: str, read: bool) -> int:
    """Logged rows visible (read) or not (unread) in the snapshot of the tick their shard's cursor is at."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(
            f"""SELECT count(*) FROM "{schema}".outbox AS o
                JOIN "{schema}".outbox_cursor AS c ON c.shard = o.shard
                JOIN "{schema}".outbox_tick AS t ON t.tick = c.tick
                WHERE o.state = 'logged' AND pg_visible_in_snapshot(o.txid, t.snapshot) = %s""",
            (read,),
        ).fetchone()
    assert found is not None
    return int(str(found[0]))


def rows_in_state(database_url: str, schema: str, state: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE state = %s', (state,)).fetchone()
    assert found is not None
    return int(str(found[0]))


@QUEUE_ONLY  # a switch from queue mode to log mode
def test_a_switch_that_cannot_lock_the_outbox_gives_up_with_a_clear_error(
    servers: Servers, schema: str
) -> None:
    """A writer's open transaction (like a relay's open batch) holds the outbox: the switch waits at most
    its lock_timeout, changes nothing and says what to do."""
    writer = psycopg.connect(servers.database_url)
    enqueue(writer, "order", "o-1", "Placed", {}, schema=schema)  # uncommitted: holds a lock on the outbox
    try:
        with connect(servers.database_url, schema) as conn:
            started = time.monotonic()
            with pytest.raises(SwitchRefused, match="stop the relays first"):
                switch_mode(conn, schema, "log", lock_timeout=0.5)
            assert time.monotonic() - started < 5
    finally:
        writer.rollback()
        writer.close()
    with connect(servers.database_url, schema) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_mode").fetchone() == (0,), "nothing switched"
