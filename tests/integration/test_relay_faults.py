"""The relay's promises under real faults: killed relays, a stopped broker, competing replicas, bad rows.

Every test uses real processes (`postbox relay run` children, real brokers and databases) and judges the
result with tests.support.delivery.check_delivery, which trusts only what the broker holds. Every test runs
against both sources, the outbox read as a log and as a queue; where the modes differ by design (what a
row records while it waits, what a held topic holds), each mode's documented behaviour is asserted.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from postbox.relay.outbox import OutboxEvent, enqueue, enqueue_many
from tests.support.database import newest_tick, outbox_states, prepare_outbox, shard_owners
from tests.support.delivery import check_delivery, sequenced_writers, write_sequenced
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES
from tests.support.probes import http_get
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

pytestmark = BOTH_MODES


def test_per_aggregate_order_holds_with_three_relays_and_interleaved_writers(
    servers: Servers, schema: str
) -> None:
    aggregate_type = f"acct{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    relays = [RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "25")]
    try:
        # About six seconds of writing, so replicas join and rebalance mid-stream.
        writers = sequenced_writers(servers.database_url, schema, aggregate_type, written, pause=0.06)
        for writer in writers:
            writer.start()
        # The first relay owns every shard; the next two make it hand shards over mid-stream.
        wait_until(
            lambda: shard_owners(servers.database_url, schema) == {relays[0].relay_id: 64},
            30,
            what="the first relay owning every shard",
        )
        relays += [
            RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "25")
            for _ in range(2)
        ]
        for writer in writers:
            writer.join(timeout=120)
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 1200},
            90,
            what="all 1200 rows published",
        )
        owners = (
            psycopg.connect(servers.database_url, autocommit=True)
            .execute(
                f'SELECT count(DISTINCT owner) FROM "{schema}".outbox_shard_lease WHERE owner IS NOT NULL'
            )
            .fetchone()
        )
        assert owners == (3,), "the three replicas share the shards"
        assert [r.terminate() for r in relays] == [0, 0, 0]
    finally:
        for relay in relays:
            relay.__exit__()
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


def test_a_relay_killed_mid_batch_again_and_again_loses_nothing(servers: Servers, schema: str) -> None:
    aggregate_type = f"kill{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    write_sequenced(
        servers.database_url, schema, aggregate_type, [f"a{i}" for i in range(20)], 150, written, 7
    )
    published_before = 0
    for kill_number in range(4):
        with RelayProcess(
            servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "40"
        ) as relay:
            target = published_before + 300
            wait_until(
                lambda target=target: (
                    outbox_states(servers.database_url, schema).get("published", 0) >= target
                ),
                60,
                interval=0.01,
                what=f"{target} published before kill {kill_number}",
            )
            # A random instant, not a wait for anything: the kill lands anywhere in the loop (read,
            # produce, wait, mark or move the cursor, commit).
            time.sleep(random.random() * 0.05)
            relay.kill()
        published_before = outbox_states(servers.database_url, schema).get("published", 0)
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--batch-size", "40") as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 3000}, 60, what="drained"
        )
        assert relay.terminate() == 0
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


def test_a_broker_stopped_longer_than_the_delivery_timeout_loses_nothing(
    servers: Servers, schema: str, own_kafka: Any, relay_mode: str
) -> None:
    aggregate_type = f"down{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    write_sequenced(servers.database_url, schema, aggregate_type, ["a", "b", "c"], 20, written, 1)
    with RelayProcess(servers.database_url, own_kafka.bootstrap, schema, "--delivery-timeout", "2") as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 60}, 60, what="phase 1"
        )
        own_kafka.stop_node(own_kafka.nodes[0])
        write_sequenced(servers.database_url, schema, aggregate_type, ["d", "e"], 30, written, 2)

        def pending_rows() -> tuple[int, int, bool]:
            with psycopg.connect(servers.database_url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*), coalesce(min(attempts), 0), "
                    "coalesce(bool_and(last_error IS NOT NULL), false) "
                    f"FROM \"{schema}\".outbox WHERE state = 'pending'"
                ).fetchone()
            assert row is not None
            return int(row[0]), int(row[1]), bool(row[2])

        # The rows written while the broker is gone get attempted (more than one delivery timeout) and
        # stay to publish.
        if relay_mode == "queue":  # each pending row records its attempts and the reason
            wait_until(lambda: pending_rows()[1] >= 2, 60, what="each pending row attempted twice")
            count, attempts, reasons = pending_rows()
            assert count == 60, "rows stay pending while the broker is down"
            assert attempts >= 2
            assert reasons, "and the reason is recorded"
        else:  # log mode writes nothing to a row it has not published; its cursor stays before the first
            # that failed, so the head of the log is attempted again and the rest wait their turn
            wait_until(
                lambda: relay.log().count('"relay_rows_retried"') >= 2, 60, what="the head attempted twice"
            )
            assert pending_rows()[0] == 0, "the rows stay as written (logged), unmarked"
        assert outbox_states(servers.database_url, schema) == {"published": 60, "pending": 60}
        own_kafka.start_node(own_kafka.nodes[0])
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 120},
            90,
            what="recovered without a restart",
        )
        assert relay.terminate() == 0
        assert "relay_rows_retried" in relay.log()
    records = read_topic(own_kafka.bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


def test_a_too_large_payload_is_parked_while_its_neighbours_flow(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    aggregate_type = f"big{uuid.uuid4().hex[:6]}"
    small = [OutboxEvent(aggregate_type, f"a{i % 3}", "Small", {"i": i}) for i in range(10)]
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(app, small[:5], schema=schema)
        big_id = enqueue(app, aggregate_type, "a0", "Huge", {"blob": "x" * 2_000_000}, schema=schema)
        ids += enqueue_many(app, small[5:], schema=schema)
        app.commit()
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 10, "failed": 1},
            60,
            what="neighbours published, big row parked",
        )
        assert relay.terminate() == 0
        assert "relay_row_parked" in relay.log()
    row = db.execute(
        "SELECT state, attempts, last_error FROM outbox WHERE event_id = %s", (big_id,)
    ).fetchone()
    assert row is not None
    assert row[0:2] == ("failed", 1)
    assert "too large" in str(row[2]).lower()
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=10)
    assert sorted(r.headers["id"].decode() for r in records) == sorted(map(str, ids))


def test_absurd_headers_are_published_intact_or_parked_with_a_reason(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Headers the application (or another tool writing SQL) got wrong: thousands of them, one bigger
    than the broker takes, a non-string value, one pretending to be the event id. None stops the rest."""
    aggregate_type = f"hdr{uuid.uuid4().hex[:6]}"
    many = {f"h{i:05d}": "v" * 20 for i in range(5000)}
    unicode_names = {"ünï-cödé ☕": "välue 𝄞", "x" * 10_000: "long name"}
    with psycopg.connect(servers.database_url) as app:
        many_id = enqueue(app, aggregate_type, "a", "Many", {"n": 1}, headers=many, schema=schema)
        huge_id = enqueue(
            app, aggregate_type, "b", "Huge", {"n": 2}, headers={"h": "x" * 2_000_000}, schema=schema
        )
        odd_id = enqueue(app, aggregate_type, "c", "Odd", {"n": 3}, headers=unicode_names, schema=schema)
        forged_id = enqueue(
            app, aggregate_type, "d", "Forged", {"n": 4}, headers={"id": "not-me"}, schema=schema
        )
        app.commit()
    # Rows written by hand (enqueue refuses both): a header that is not a string, and one with an empty
    # name (Kafka clients drop those on the way); neither can be published as written.
    hand_written = [
        db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
            "VALUES (%s, %s, 'ByHand', '{}', %s) RETURNING event_id",
            (aggregate_type, aggregate, headers),
        ).fetchone()
        for aggregate, headers in (("e", '{"n": 5}'), ("f", '{"": "empty name"}'))
    ]
    assert hand_written[0] is not None
    assert hand_written[1] is not None
    number_id, empty_name_id = hand_written[0][0], hand_written[1][0]
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 3, "failed": 3},
            60,
            what="three published, three parked",
        )
        assert relay.terminate() == 0
    reasons = dict(db.execute("SELECT event_id, last_error FROM outbox WHERE state = 'failed'").fetchall())
    assert "too large" in str(reasons[huge_id]).lower()
    assert "'n' is not a string" in str(reasons[number_id])
    assert "empty" in str(reasons[empty_name_id])
    records = {
        r.headers["id"].decode(): r
        for r in read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=3)
    }
    assert sorted(records) == sorted(map(str, (many_id, odd_id, forged_id)))
    assert len(records[str(many_id)].headers) == 5002, "the 5,000, the id and the event type"
    assert all(records[str(many_id)].headers[name] == b"v" * 20 for name in many)
    assert {k: v for k, v in records[str(odd_id)].headers.items() if k not in ("id", "eventType")} == {
        name: value.encode() for name, value in unicode_names.items()
    }
    assert records[str(forged_id)].headers == {"id": str(forged_id).encode(), "eventType": b"Forged"}, (
        "the event id cannot be forged"
    )


def test_rows_of_a_transaction_that_commits_late_are_still_published(
    servers: Servers, schema: str, relay_mode: str
) -> None:
    aggregate_type = f"late{uuid.uuid4().hex[:6]}"
    late_conn = psycopg.connect(servers.database_url)
    late_id = enqueue(late_conn, aggregate_type, "slow", "Late", {"seq": 0}, schema=schema)  # not committed
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        with psycopg.connect(servers.database_url) as app:
            early = enqueue_many(
                app,
                [OutboxEvent(aggregate_type, f"fast{i}", "Early", {"seq": i}) for i in range(20)],
                schema=schema,
            )
            app.commit()
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 20},
            30,
            what="the committed rows, published past the open transaction",
        )
        if relay_mode == "log":  # windows close past the open transaction, its row in none of them
            tick = newest_tick(servers.database_url, schema)
            wait_until(
                lambda: newest_tick(servers.database_url, schema) >= tick + 3,
                10,
                what="three more ticks taken with the transaction open",
            )
        late_conn.commit()  # its row has a lower id than every published one
        late_conn.close()
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 21},
            30,
            what="the late row published too",
        )
        assert relay.terminate() == 0
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=21)
    assert {r.headers["id"].decode() for r in records} == {str(i) for i in [late_id, *early]}


def _readyz(relay: RelayProcess) -> tuple[int, str]:
    return http_get(relay.metrics_port, "/readyz")


def test_an_unknown_topic_is_held_back_the_rest_flows_and_the_relay_is_unready(
    servers: Servers, schema: str, own_kafka_no_autocreate: Any, relay_mode: str
) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415

    kafka = own_kafka_no_autocreate
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    admin.create_topics([NewTopic("outbox.event.known", 3, 1)])["outbox.event.known"].result(30)
    with psycopg.connect(servers.database_url) as app:
        enqueue_many(app, [OutboxEvent("missing", "m", "E", {"i": i}) for i in range(5)], schema=schema)
        known = enqueue_many(app, [OutboxEvent("known", "k", "E", {"i": i}) for i in range(5)], schema=schema)
        app.commit()
    with RelayProcess(
        servers.database_url, kafka.bootstrap, schema, "--topic-recheck-interval", "1"
    ) as relay:
        # Queue mode leaves them pending (the claim skips the topic); log mode parks them as held.
        held_state = "pending" if relay_mode == "queue" else "failed"
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 5, held_state: 5},
            60,
            what="the known topic's rows published, the missing topic's held",
        )
        wait_until(lambda: _readyz(relay)[0] == 503, 10, what="unready")
        assert "outbox.event.missing" in _readyz(relay)[1]
        admin.create_topics([NewTopic("outbox.event.missing", 1, 1)])["outbox.event.missing"].result(30)
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 10},
            60,
            what="held rows flow once the topic exists",
        )
        wait_until(lambda: _readyz(relay)[0] == 200, 10, what="ready again")
        assert relay.terminate() == 0
    records = read_topic(kafka.bootstrap, "outbox.event.known", expected=5)
    assert sorted(r.headers["id"].decode() for r in records) == sorted(map(str, known))


def test_the_relay_rides_out_a_postgres_crash_restart(
    own_postgres: Any, servers: Servers, relay_mode: str
) -> None:
    prepare_outbox(own_postgres.dsn, "postbox", relay_mode)
    aggregate_type = f"pgcrash{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    write_sequenced(own_postgres.dsn, "postbox", aggregate_type, [f"a{i}" for i in range(5)], 100, written, 3)
    with RelayProcess(own_postgres.dsn, servers.kafka_bootstrap, "postbox", "--batch-size", "20") as relay:
        wait_until(
            lambda: outbox_states(own_postgres.dsn, "postbox").get("published", 0) >= 100,
            60,
            interval=0.01,
            what="some published",
        )
        own_postgres.restart_immediate()
        wait_until(
            lambda: outbox_states(own_postgres.dsn, "postbox") == {"published": 500},
            90,
            what="drained after the crash",
        )
        assert relay.terminate() == 0
        assert "relay_database_unavailable" in relay.log()
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


@pytest.mark.parametrize("signal_name", ["SIGTERM"])
def test_sigterm_releases_the_leases_and_exits_zero(
    servers: Servers, schema: str, signal_name: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM outbox_shard_lease WHERE owner = %s", (relay.relay_id,)
                ).fetchone()
                == (64,)
            ),
            20,
            what="all shards owned",
        )
        assert relay.terminate() == 0
    assert db.execute("SELECT count(*) FROM outbox_shard_lease WHERE owner IS NOT NULL").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM outbox_relay_member").fetchone() == (0,)


def test_a_paused_replica_loses_its_shards_and_its_return_breaks_no_order(
    servers: Servers, schema: str
) -> None:
    """SIGSTOP one of two replicas mid-stream (a zombie holding leases), keep writing, then SIGCONT it."""
    aggregate_type = f"zombie{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    extra = ("--batch-size", "20", "--delivery-timeout", "2")
    with (
        RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, *extra) as zombie,
        RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, *extra) as survivor,
    ):
        writer = threading.Thread(
            target=write_sequenced,
            args=(
                servers.database_url,
                schema,
                aggregate_type,
                [f"a{i}" for i in range(12)],
                60,
                written,
                11,
                0.04,
            ),
        )
        writer.start()
        wait_until(
            lambda: set(shard_owners(servers.database_url, schema)) == {zombie.relay_id, survivor.relay_id},
            30,
            what="both owning shards",
        )
        zombie.pause()
        writer.join(timeout=120)
        # The survivor takes the zombie's shards once their leases expire (3 s) and ends the zombie's
        # sessions, so a batch the zombie left open cannot hold its rows until the server's idle timeout
        # (delivery timeout + 30 s = 32 s here).
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 720},
            25,
            what="the survivor drains everything",
        )
        zombie.resume()
        # The zombie wakes, finds its leases (or its sessions) gone, and must not publish out of order.
        wait_until(
            lambda: "relay_leases_lost" in zombie.log() or "relay_database_unavailable" in zombie.log(),
            30,
            what="the zombie finding its leases gone",
        )
        assert survivor.terminate() == 0
        assert zombie.terminate() == 0
        assert "relay_expired_member_fenced" in survivor.log(), "the survivor ended the zombie's sessions"
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


def test_an_idle_relay_whose_sessions_are_terminated_reconnects(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Found by the soak: a LISTEN session ended while the relay waited used to crash it."""
    aggregate_type = f"term{uuid.uuid4().hex[:6]}"

    def idle() -> bool:
        """Every session of the relay's connected and idle (none in a statement or a transaction)."""
        found = db.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'idle') FROM pg_stat_activity "
            "WHERE application_name = %s",
            (f"postbox-relay {relay.relay_id}",),
        ).fetchone()
        return found is not None and int(str(found[0])) >= 5 and found[0] == found[1]

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, "--poll-interval", "2") as relay:
        wait_until(lambda: "relay_shards_acquired" in relay.log(), 20, what="the relay up")
        wait_until(idle, 20, what="the relay idle, waiting on NOTIFY")
        ended = db.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (f"postbox-relay {relay.relay_id}",),
        ).fetchone()
        assert ended == (5,), "two lanes, lease, LISTEN and housekeeping sessions"
        with psycopg.connect(servers.database_url) as app:
            enqueue(app, aggregate_type, "a", "E", {"seq": 0}, schema=schema)
            app.commit()
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 1},
            30,
            what="published after reconnecting",
        )
        assert relay.process.poll() is None
        assert relay.terminate() == 0
        assert "relay_database_unavailable" in relay.log()


def test_the_daemon_prunes_published_rows_on_its_schedule_and_never_the_others(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    aggregate_type = f"prune{uuid.uuid4().hex[:6]}"
    with psycopg.connect(servers.database_url) as app:
        enqueue_many(
            app, [OutboxEvent(aggregate_type, f"a{i}", "E", {"seq": i}) for i in range(30)], schema=schema
        )
        app.commit()
    db.execute(
        "UPDATE outbox SET state = 'failed', last_error = 'parked for the test' WHERE id IN "
        "(SELECT id FROM outbox ORDER BY id LIMIT 2)"
    )
    with RelayProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        "--prune-retention",
        "1s",
        "--prune-interval",
        "1",
    ) as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"failed": 2},
            60,
            what="published rows pruned by the daemon, parked ones kept",
        )
        assert relay.terminate() == 0
        assert "relay_pruned" in relay.log()


def test_delete_on_publish_deletes_what_kafka_acknowledged_and_keeps_parked_rows(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]], relay_mode: str
) -> None:
    """Queue mode deletes each row in the statement that would mark it published. Log mode marks no row
    it publishes (only its cursors move), so the flag deletes nothing there: no row is lost before it is
    read, and retention empties the partitions later."""
    aggregate_type = f"del{uuid.uuid4().hex[:6]}"
    with psycopg.connect(servers.database_url) as app:
        ids = enqueue_many(
            app, [OutboxEvent(aggregate_type, f"a{i % 4}", "E", {"seq": i}) for i in range(50)], schema=schema
        )
        big_id = enqueue(app, aggregate_type, "a9", "Huge", {"blob": "x" * 2_000_000}, schema=schema)
        app.commit()
    with RelayProcess(
        servers.database_url, servers.kafka_bootstrap, schema, "--delete-on-publish", "--batch-size", "16"
    ) as relay:
        left = {"failed": 1} if relay_mode == "queue" else {"published": len(ids), "failed": 1}
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == left,
            60,
            what="published rows deleted (queue mode) or left as read (log mode), the parked one kept",
        )
        assert relay.terminate() == 0
    row = db.execute("SELECT event_id, last_error FROM outbox WHERE state = 'failed'").fetchone()
    assert row is not None
    assert row[0] == big_id
    assert "too large" in str(row[1]).lower()
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(ids))
    assert sorted(r.headers["id"].decode() for r in records) == sorted(map(str, ids))


def test_a_relay_that_lost_leases_and_then_its_connection_carries_on(
    servers: Servers, schema: str, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Found by the soak: after losing leases and then reconnecting, the relay's lost-lease count went
    negative and the metrics library refused it, ending the process."""
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(lambda: "relay_shards_acquired" in relay.log(), 20, what="the relay up")
        # Its leases expire under it (as after a long stall), and its next tick counts them lost ...
        db.execute(
            "UPDATE outbox_shard_lease SET expires_at = now() - interval '1 second' WHERE owner = %s",
            (relay.relay_id,),
        )
        wait_until(lambda: "relay_leases_lost" in relay.log(), 10, what="the loss noticed")
        # ... then its database sessions end, and it reconnects with a fresh lease keeper.
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (f"postbox-relay {relay.relay_id}",),
        )
        wait_until(lambda: relay.log().count("relay_connected") >= 2, 15, what="reconnected")
        turns = relay.log().count('"relay_lease_turn"')
        wait_until(
            lambda: relay.process.poll() is not None or relay.log().count('"relay_lease_turn"') >= turns + 3,
            15,
            what="three lease turns with the fresh keeper",
        )
        assert relay.process.poll() is None, relay.log()[-2000:]
        assert relay.terminate() == 0


def test_readyz_answers_503_while_the_broker_is_down_past_the_grace_and_200_once_back(
    servers: Servers, schema: str, own_kafka: Any
) -> None:
    with RelayProcess(servers.database_url, own_kafka.bootstrap, schema, "--delivery-timeout", "6") as relay:
        wait_until(lambda: _readyz(relay)[0] == 200, 30, what="ready")
        own_kafka.stop_node(own_kafka.nodes[0], kill=True)
        stopped = time.monotonic()
        assert _readyz(relay)[0] == 200, "a blip shorter than the delivery timeout keeps it ready"
        wait_until(lambda: _readyz(relay)[0] == 503, 30, what="unready with the broker gone")
        assert time.monotonic() - stopped >= 5, "not before the grace period"
        assert "Kafka unusable" in _readyz(relay)[1]
        own_kafka.start_node(own_kafka.nodes[0])
        wait_until(lambda: _readyz(relay)[0] == 200, 60, what="ready again")
        assert relay.terminate() == 0


def test_readyz_answers_503_when_the_broker_refuses_our_credentials(servers: Servers, schema: str) -> None:
    password = "kafka-hunter2"
    sasl = ["security.protocol=SASL_PLAINTEXT", "sasl.mechanism=PLAIN", "sasl.username=u"]
    flags = [arg for pair in sasl for arg in ("--kafka-config", pair)]
    with RelayProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        "--delivery-timeout",
        "3",
        *flags,
        env={"POSTBOX_RDKAFKA_SASL_PASSWORD": password},
    ) as relay:
        wait_until(lambda: _readyz(relay)[0] == 503 and "Kafka" in _readyz(relay)[1], 30, what="unready")
        assert "SASL" in _readyz(relay)[1]
        assert relay.terminate() == 0
        assert password not in relay.log()
