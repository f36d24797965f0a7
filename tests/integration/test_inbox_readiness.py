"""The inbox consumer's /readyz means what Kubernetes assumes: ready while connected to PostgreSQL and a
member of its consumer group, whether or not messages arrive; not ready, with the true reason, while the
database or the brokers are gone; ready again once they are back. (It used to answer "not connected to
PostgreSQL" until the first message arrived, so the rollout of a quiet consumer never completed.)"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from postbox.relay.core.migrate import migrate
from tests.support.kafka import create_topic
from tests.support.probes import http_get
from tests.support.processes import InboxProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until

APP = "tests.apps.bank:inbox"


def _ready(process: InboxProcess) -> tuple[int, str]:
    return http_get(process.metrics_port, "/readyz")


def _wait_ready(process: InboxProcess, seconds: float, what: str) -> str:
    wait_until(lambda: _ready(process)[0] == 200, seconds, what=what)
    return _ready(process)[1]


def _wait_unready(process: InboxProcess, seconds: float, what: str) -> str:
    wait_until(lambda: _ready(process)[0] == 503, seconds, what=what)
    return _ready(process)[1]


def test_a_consumer_of_an_idle_topic_is_ready(servers: Servers, schema: str) -> None:
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 2)
    with InboxProcess(servers.database_url, servers.kafka_bootstrap, schema, APP, [topic]) as consumer:
        body = _wait_ready(consumer, 45, "ready with no message ever arriving")
        assert "a member of consumer group 'bank'" in body, body
        assert consumer.terminate() == 0


def test_a_consumer_is_unready_while_the_broker_is_stopped_and_ready_once_it_is_back(
    servers: Servers, schema: str, own_kafka: Any
) -> None:
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(own_kafka.bootstrap, topic, 1)
    with InboxProcess(servers.database_url, own_kafka.bootstrap, schema, APP, [topic]) as consumer:
        _wait_ready(consumer, 45, "ready")
        own_kafka.stop_node(own_kafka.nodes[0])
        body = _wait_unready(consumer, 60, "unready with the broker stopped")
        assert "Kafka broker" in body or "consumer group" in body, body
        assert "PostgreSQL" not in body, "the reason is the broker's, not the database's"
        assert http_get(consumer.metrics_port, "/healthz")[0] == 200, "alive: only not ready"
        own_kafka.start_node(own_kafka.nodes[0])
        _wait_ready(consumer, 120, "ready again once the broker is back")
        assert consumer.terminate() == 0


def test_a_consumer_is_unready_while_its_database_is_gone_and_ready_once_it_is_back(
    servers: Servers, own_postgres: Any
) -> None:
    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    with InboxProcess(own_postgres.dsn, servers.kafka_bootstrap, "postbox", APP, [topic]) as consumer:
        _wait_ready(consumer, 45, "ready")
        own_postgres.crash()
        body = _wait_unready(consumer, 30, "unready with the database gone")
        assert "PostgreSQL" in body, body
        assert http_get(consumer.metrics_port, "/healthz")[0] == 200, "alive: only not ready"
        own_postgres.start_again()
        _wait_ready(consumer, 60, "ready again once the database is back")
        assert consumer.terminate() == 0
