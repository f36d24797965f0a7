"""Network partitions: between the relay and the broker (the broker runs in a network namespace of the
test's own, and an nftables rule drops everything sent to it for longer than the delivery timeout), and
between each daemon and its database. The relay's run against both sources (log and queue mode)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from postbox.relay.core.migrate import migrate
from postbox.relay.devstack.kafka import LocalKafka
from tests.chaos.netns import NetNamespace
from tests.support.database import outbox_states, prepare_outbox
from tests.support.delivery import check_delivery, write_sequenced
from tests.support.kafka import read_topic
from tests.support.modes import BOTH_MODES
from tests.support.processes import RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until


@pytest.fixture
def partitionable_kafka() -> Iterator[tuple[LocalKafka, NetNamespace]]:
    namespace = NetNamespace().create()
    kafka = LocalKafka(host=namespace.ns_ip, command_prefix=namespace.exec_prefix)
    try:
        kafka.start()
        yield kafka, namespace
    finally:
        kafka.stop()
        namespace.destroy()


def attempted_pending(database_url: str, schema: str) -> tuple[int, int]:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            f"SELECT count(*), coalesce(min(attempts), 0) FROM \"{schema}\".outbox WHERE state = 'pending'"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@BOTH_MODES
def test_a_network_cut_to_the_broker_loses_nothing_and_heals_by_itself(
    servers: Servers, schema: str, partitionable_kafka: tuple[LocalKafka, NetNamespace], relay_mode: str
) -> None:
    kafka, namespace = partitionable_kafka
    aggregate_type = f"cut{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    write_sequenced(servers.database_url, schema, aggregate_type, ["a", "b", "c"], 10, written, 5)
    with RelayProcess(servers.database_url, kafka.bootstrap, schema, "--delivery-timeout", "3") as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 30}, 60, what="phase 1"
        )
        namespace.cut()
        try:
            write_sequenced(servers.database_url, schema, aggregate_type, ["d", "e"], 15, written, 6)
            # Nothing answers, nothing refuses: the rows must still be attempted, time out, and stay to
            # publish. In queue mode each row is claimed, attempted and left pending with its attempts
            # counted. In log mode the rows stay as written (the relay writes nothing to a row it has not
            # published) and its cursor stays before the first that failed: the head of the log is
            # attempted again and again, the rows behind it wait their turn.
            if relay_mode == "queue":
                wait_until(
                    lambda: attempted_pending(servers.database_url, schema)[1] >= 2,
                    60,
                    what="each row attempted twice during the cut",
                )
                assert attempted_pending(servers.database_url, schema)[0] == 30
            else:
                wait_until(
                    lambda: relay.log().count('"relay_rows_retried"') >= 2,
                    60,
                    what="the head of the log attempted twice during the cut",
                )
            assert outbox_states(servers.database_url, schema) == {"published": 30, "pending": 30}
            assert relay.process.poll() is None
        finally:
            namespace.restore()
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 60},
            90,
            what="healed without a restart",
        )
        assert relay.terminate() == 0
    records = read_topic(kafka.bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


@BOTH_MODES
def test_a_network_cut_to_the_database_is_noticed_and_healed(
    own_postgres: Any, servers: Servers, relay_mode: str
) -> None:
    """Packets from the relay to its database vanish (nftables drops them on the way out): without
    client-side liveness settings the relay would wait on TCP retransmissions for many minutes."""
    prepare_outbox(own_postgres.dsn, "postbox", relay_mode)
    aggregate_type = f"dbcut{uuid.uuid4().hex[:6]}"
    written: dict[str, tuple[str, int]] = {}
    write_sequenced(own_postgres.dsn, "postbox", aggregate_type, ["a", "b"], 10, written, 8)
    rule = (
        "table inet postbox_dbcut {\n  chain output {\n    type filter hook output priority 0;\n"
        f"    tcp dport {own_postgres.port} drop\n  }}\n}}\n"
    )
    with RelayProcess(own_postgres.dsn, servers.kafka_bootstrap, "postbox") as relay:
        wait_until(
            lambda: outbox_states(own_postgres.dsn, "postbox") == {"published": 20}, 60, what="phase 1"
        )
        subprocess.run(["nft", "-f", "-"], input=rule, text=True, check=True)
        try:
            wait_until(
                lambda: "relay_database_unavailable" in relay.log(),
                60,
                interval=0.5,
                what="the relay noticing its database is gone",
            )
            assert relay.process.poll() is None
        finally:
            subprocess.run(["nft", "delete", "table", "inet", "postbox_dbcut"], check=True)
        write_sequenced(own_postgres.dsn, "postbox", aggregate_type, ["c"], 10, written, 9)
        wait_until(
            lambda: outbox_states(own_postgres.dsn, "postbox") == {"published": 30},
            90,
            what="healed without a restart",
        )
        assert relay.terminate() == 0
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{aggregate_type}", expected=len(written))
    check_delivery(records, written)


def test_a_network_cut_to_the_database_is_survived_by_the_inbox_consumer_and_the_webhook_worker(
    own_postgres: Any, servers: Servers
) -> None:
    """The consumer and the worker lose their database to silently dropped packets (no reset, no error
    from the server): each notices through the connection's liveness settings, reconnects once the
    network is back, and goes on without a restart and without losing the work sent meanwhile."""
    from tests.apps.bank import SCHEMA_SQL as BANK_SQL  # noqa: PLC0415
    from tests.apps.hooks import SCHEMA_SQL as HOOKS_SQL  # noqa: PLC0415
    from tests.support.database import execute_script  # noqa: PLC0415
    from tests.support.kafka import create_topic, produce  # noqa: PLC0415
    from tests.support.processes import InboxProcess, WorkerProcess  # noqa: PLC0415

    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
        execute_script(conn, f"{BANK_SQL};{HOOKS_SQL}")
    topic = f"cut-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)

    def one(sql: str) -> object:
        with psycopg.connect(own_postgres.dsn) as conn:
            return conn.execute(sql).fetchone()

    rule = (
        "table inet postbox_daemoncut {\n  chain output {\n    type filter hook output priority 0;\n"
        f"    tcp dport {own_postgres.port} drop\n  }}\n}}\n"
    )
    with (
        InboxProcess(
            own_postgres.dsn, servers.kafka_bootstrap, "postbox", "tests.apps.bank:inbox", [topic]
        ) as inbox,
        WorkerProcess(own_postgres.dsn, "postbox") as worker,
    ):
        produce(servers.kafka_bootstrap, topic, [("n1", "Deposit", {"account": "acc", "amount": 1})])
        wait_until(lambda: one("SELECT balance FROM accounts") == (1,), 60, what="a deposit before the cut")
        subprocess.run(["nft", "-f", "-"], input=rule, text=True, check=True)
        try:
            # The consumer touches its database only when a batch arrives: send one into the cut.
            produce(servers.kafka_bootstrap, topic, [("n2", "Deposit", {"account": "acc", "amount": 1})])
            wait_until(
                lambda: (
                    "inbox_database_unavailable" in inbox.log()
                    and "webhook_worker_database_unavailable" in worker.log()
                ),
                90,
                interval=0.5,
                what="both noticing the database is unreachable",
            )
            assert inbox.process.poll() is None
            assert worker.process.poll() is None
        finally:
            subprocess.run(["nft", "delete", "table", "inet", "postbox_daemoncut"], check=True)
        with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO postbox.webhook_inbox (provider, event_id, event_type, payload) "
                "VALUES ('stripe', 'evt_after_cut', 'invoice.paid', '{}')"
            )
        wait_until(
            lambda: one("SELECT balance FROM accounts") == (2,), 90, what="the deposit sent into the cut"
        )
        wait_until(lambda: one("SELECT count(*) FROM applied") == (1,), 90, what="the webhook after the cut")
        assert inbox.terminate() == 0
        assert worker.terminate() == 0
