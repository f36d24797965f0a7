"""The inbox consumer on real servers: duplicates, crashes between the two commits, poison, rebalances."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg

from tests.apps.bank import APP
from tests.support.bank import deposits, effects
from tests.support.kafka import create_topic, produce, read_topic
from tests.support.processes import InboxProcess
from tests.support.servers import Servers
from tests.support.waiting import holds_for, wait_until

Conn = psycopg.Connection[tuple[object, ...]]


def total(db: Conn) -> int:
    row = db.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()
    assert row is not None
    return int(str(row[0]))


def test_an_event_delivered_three_times_to_two_consumers_at_once_applies_once(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 3)
    once = deposits(1, amount=100)
    others = deposits(50)
    produce(servers.kafka_bootstrap, topic, once + others[:25] + once + others[25:] + once)
    # Two instances of the same service (one inbox), each in its own consumer group: every message reaches
    # both, at the same time, and the twice-three copies of `once` race for the same claim.
    with (
        InboxProcess(
            servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], "--group-id", f"g1-{topic}"
        ) as first,
        InboxProcess(
            servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], "--group-id", f"g2-{topic}"
        ) as second,
    ):
        wait_until(lambda: len(effects(bank)) == 51, 60, what="every distinct event applied")
        holds_for(  # room for a late double application to show
            lambda: set(effects(bank).values()) == {1}, 2, what="no event applied twice"
        )
        assert first.terminate() == 0
        assert second.terminate() == 0
    assert set(effects(bank).values()) == {1}, "no event applied twice"
    assert total(bank) == 100 + 50 * 10
    claimed = bank.execute("SELECT count(*), min(status), max(status) FROM inbox_message").fetchone()
    assert claimed == (51, "done", "done")


def test_a_consumer_killed_between_its_commit_and_its_offset_commit_does_nothing_twice(
    servers: Servers, schema: str, bank: Conn, tmp_path: Path
) -> None:
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    events = deposits(40)
    produce(servers.kafka_bootstrap, topic, events)
    flag = tmp_path / "crashed"
    group = f"g-{topic}"
    with InboxProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        APP,
        [topic],
        "--group-id",
        group,
        "--batch-size",
        "10",
        env={"BANK_CRASH_FLAG": str(flag)},
    ) as victim:
        assert victim.process.wait(timeout=60) == -9, "killed itself right after the database commit"
    applied_before = effects(bank)
    assert len(applied_before) == 10, "the first batch was committed before the crash"
    assert set(flag.read_text().split(",")) == set(applied_before)
    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], "--group-id", group
    ) as survivor:
        wait_until(lambda: len(effects(bank)) == 40, 60, what="the rest applied")
        wait_until(
            lambda: '"duplicates": 10' in survivor.log(), 10, what="the crashed batch re-read as duplicates"
        )
        assert survivor.terminate() == 0
    assert set(effects(bank).values()) == {1}, "the re-read batch was all duplicates"
    assert total(bank) == 400


def test_a_poison_message_is_parked_sent_to_the_dead_letter_topic_and_the_partition_moves_on(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic, dlq = f"bank-{uuid.uuid4().hex[:8]}", f"bank-dlq-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    poison = (f"poison-{uuid.uuid4().hex}", "Poison", {"account": "p"})
    refused = (f"refused-{uuid.uuid4().hex}", "Refused", {"account": "r"})
    before, after = deposits(5), deposits(5)
    produce(servers.kafka_bootstrap, topic, [*before, poison, refused, *after], key="same-key")
    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], env={"BANK_DLQ": dlq}
    ) as consumer:
        wait_until(lambda: len(effects(bank)) == 10, 60, what="the messages after the poison applied")
        assert consumer.terminate() == 0
        assert "inbox_handler_retry" in consumer.log()
    parked = {
        str(row[0]): tuple(row[1:])
        for row in bank.execute(
            "SELECT message_id, status, attempts, error FROM inbox_message WHERE status = 'failed'"
        ).fetchall()
    }
    assert parked[poison[0]] == ("failed", 3, "RuntimeError: this event can never be applied")
    assert parked[refused[0]] == ("failed", 1, "PermanentError: account closed"), "permanent: no retries"
    assert poison[0] not in effects(bank), "the poison handler's writes were rolled back"
    dead = read_topic(servers.kafka_bootstrap, dlq, expected=2)
    assert sorted(r.headers["id"].decode() for r in dead) == sorted([poison[0], refused[0]])
    assert all(r.headers["postbox.source"].decode().startswith(f"{topic}/0/") for r in dead)


def test_a_message_without_an_id_is_parked_under_its_coordinates(
    servers: Servers, schema: str, bank: Conn
) -> None:
    from confluent_kafka import Producer  # noqa: PLC0415

    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    producer = Producer({"bootstrap.servers": servers.kafka_bootstrap})
    producer.produce(topic, b'{"account": "x", "amount": 1}', b"x", headers=[("eventType", b"Deposit")])
    producer.flush(30)
    produce(servers.kafka_bootstrap, topic, deposits(1))
    with InboxProcess(servers.database_url, servers.kafka_bootstrap, schema, APP, [topic]) as consumer:
        wait_until(lambda: len(effects(bank)) == 1, 60, what="the next message applied")
        assert consumer.terminate() == 0
    row = bank.execute(
        "SELECT message_id, status, error FROM inbox_message WHERE status = 'failed'"
    ).fetchone()
    assert row == (f"{topic}/0/0", "failed", "message id: no 'id' header")


def test_a_rebalance_between_two_consumers_loses_and_doubles_nothing(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 6)
    events = deposits(3000, accounts=40, amount=1)
    produce(servers.kafka_bootstrap, topic, events[:1500])
    group = f"g-{topic}"
    args = (
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        APP,
        [topic],
        "--group-id",
        group,
        "--batch-size",
        "50",
    )
    with InboxProcess(*args) as first:
        wait_until(lambda: len(effects(bank)) >= 300, 60, what="the first consumer under way")
        with InboxProcess(*args) as second:
            produce(servers.kafka_bootstrap, topic, events[1500:])
            wait_until(lambda: "inbox_partitions_assigned" in second.log(), 60, what="the second one joins")
            wait_until(lambda: len(effects(bank)) >= 2000, 60, what="both under way")
            assert first.terminate() == 0  # its partitions move to the second mid-stream
            wait_until(lambda: len(effects(bank)) == 3000, 90, what="everything applied")
            holds_for(lambda: set(effects(bank).values()) == {1}, 2, what="nothing applied twice")
            assert second.terminate() == 0
    applied = effects(bank)
    assert set(applied) == {e[0] for e in events}, "nothing lost"
    assert set(applied.values()) == {1}, "nothing doubled"
    assert total(bank) == 3000
