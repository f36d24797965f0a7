"""The servers a benchmark starts for itself and the processes that publish from them: BenchServers
(a LocalPostgres and a LocalKafka, a fresh schema and topic per run), a postbox relay as a child process
(BenchRelay) and `publishing`, which runs relays or the Debezium worker (Publisher) until a measurement is
done; what a process and the whole machine used (process_usage, machine_busy_seconds).

tests.bench.run starts PostgreSQL with wal_level=logical throughout, which Debezium needs, so both tools
see the same database."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psycopg

from postbox.relay.core.db import connect
from postbox.relay.core.migrate import migrate
from postbox.relay.devstack.kafka import LocalKafka
from postbox.relay.devstack.ports import free_port
from postbox.relay.devstack.postgres import LocalPostgres
from postbox.relay.outbox.admin import switch_mode
from tests.debezium import DebeziumConnect, outbox_router_options
from tests.support.kafka import create_topic
from tests.support.processes import ChildProcess
from tests.support.repo import REPO
from tests.support.waiting import wait_until

SCHEMA = "postbox"
PARTITIONS = 6


@dataclass
class BenchServers:
    """The servers a benchmark started for itself and owns: the LocalPostgres and LocalKafka themselves
    (their port for Debezium, their lifetime the benchmark's), one schema `postbox` that fresh_schema drops
    and migrates again for each run, and a topic of PARTITIONS partitions per run from fresh_topic.

    Not the tests' tests.support.servers.Servers, which is only where to find servers (from the environment,
    testcontainers or the local runner), shared by a whole session and possibly someone else's: each test
    migrates a schema of its own and never drops one it did not make."""

    postgres: LocalPostgres
    kafka: LocalKafka

    def fresh_schema(self, mode: str = "queue") -> None:
        with psycopg.connect(self.postgres.dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            migrate(conn, SCHEMA)
        if mode == "log":
            with connect(self.postgres.dsn, SCHEMA) as conn:
                switch_mode(conn, SCHEMA, "log")

    def fresh_topic(self, prefix: str) -> tuple[str, str]:
        """(aggregate type, its topic): a topic of its own per run, so counting its messages is exact."""
        aggregate_type = f"{prefix}{uuid.uuid4().hex[:6]}"
        topic = f"outbox.event.{aggregate_type}"
        create_topic(self.kafka.bootstrap, topic, PARTITIONS)
        return aggregate_type, topic


def process_usage(process_id: int) -> tuple[float, float]:
    """(peak resident MB, CPU seconds since it started) of a live process, from /proc. Callers take the
    CPU figure before and after what they measure, so start-up (a JVM's above all) is left out."""
    status = Path(f"/proc/{process_id}/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    fields = Path(f"/proc/{process_id}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return peak_kb / 1024, cpu


def machine_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine since boot (all cores, idle and iowait left out):
    the difference across a drain is what it cost the whole machine (PostgreSQL, Kafka and the publisher)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class Publisher(Protocol):
    """A process that moves outbox rows to Kafka: a postbox relay or the Debezium worker."""

    process_id: int

    def terminate(self, timeout: float = 30.0) -> int: ...


class BenchRelay(ChildProcess):
    """`postbox relay run` with production defaults."""

    def __init__(
        self,
        s: BenchServers,
        extra: tuple[str, ...] = (),
        log_level: str = "info",
        env: dict[str, str] | None = None,
        code: Path | None = None,
    ) -> None:
        """code: a checkout whose postbox to run (a paired before/after benchmark), else this one."""
        self.metrics_port = free_port()
        super().__init__(
            f"bench-relay-{uuid.uuid4().hex[:6]}",
            [
                "relay",
                "run",
                "--database-url",
                s.postgres.dsn,
                "--kafka-bootstrap",
                s.kafka.bootstrap,
                "--schema",
                SCHEMA,
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                *extra,
            ],
            env=env,
            log_level=log_level,
            cwd=code or REPO,
        )
        self.process_id = self.process.pid

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False


@contextlib.contextmanager
def publishing(
    s: BenchServers,
    tool: str,
    replicas: int = 1,
    relay_args: tuple[str, ...] = (),
    log_level: str = "info",
    env: dict[str, str] | None = None,
    code: Path | None = None,
) -> Iterator[list[Publisher]]:
    """`replicas` postbox relays (with `env` added to their environment, from the checkout `code` if
    given), or one Debezium worker, running and ready to publish new rows."""
    if tool == "postbox":
        relays = [BenchRelay(s, relay_args, log_level, env, code) for _ in range(replicas)]
        try:
            wait_until(lambda: all(r.ready() for r in relays), 60, interval=0.2, what="relays ready")
            if replicas > 1:
                time.sleep(6)  # let the replicas settle their shard split (leases rebalance every ttl / 3)
            yield list(relays)
        finally:
            for relay in relays:
                relay.__exit__()
        return
    debezium = DebeziumConnect(
        s.postgres.dsn, s.postgres.port, s.kafka.bootstrap, outbox_router_options(SCHEMA)
    )
    try:
        wait_until(lambda: debezium.streaming(s.postgres.dsn), 180, interval=0.5, what="Debezium streaming")
        yield [debezium]
    finally:
        debezium.close(s.postgres.dsn)
