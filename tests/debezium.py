"""Debezium's PostgreSQL connector with its outbox event router, in Kafka Connect standalone: the peer the
benchmark measures against, and the reference the compatibility test compares postbox's messages with.

Configured the way its documentation describes for an outbox table, pointed at postbox's own table (the
event router's column options name our columns), so both tools read the same rows and write the same
topics: `outbox.event.<aggregate_type>`, key = aggregate id, header `id` = event id, value = the payload's
JSON text. Connect's own producer defaults are kept (acks=all, idempotence), with the compression and
linger postbox uses, so the two differ in how they read the database, not in how they write to Kafka.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

from postbox.relay.devstack.kafka import pom_version, resolve_classpath
from postbox.relay.devstack.ports import free_port

POM = Path(__file__).with_name("debezium-pom.xml")
SLOT = "postbox_bench_debezium"

LOG4J2 = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:connect.log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
"""


def debezium_version() -> str:
    return pom_version(POM, "debezium.version")


def outbox_router_options(
    schema: str, topic_replacement: str = "outbox.event.${routedByValue}"
) -> dict[str, str]:
    """Debezium's outbox event router on postbox's own outbox table (the benchmark's peer)."""
    return {
        "name": "postbox-bench-outbox",
        "topic.prefix": "bench",
        "table.include.list": f"{schema}.outbox",
        "tombstones.on.delete": "false",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.table.field.event.id": "event_id",
        "transforms.outbox.table.field.event.key": "aggregate_id",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.route.by.field": "aggregate_type",
        "transforms.outbox.route.topic.replacement": topic_replacement,
        # The event type as an `eventType` header, which postbox sends by default (Debezium's usual
        # option for it), so the compatibility test compares that header too.
        "transforms.outbox.table.fields.additional.placement": "event_type:header:eventType",
        # postbox marks rows published with an UPDATE; the router is told those are expected.
        "transforms.outbox.table.op.invalid.behavior": "warn",
    }


def change_event_options(tables: list[str], topic_prefix: str) -> dict[str, str]:
    """Debezium's plain change events of `tables`, every option at its default (the capture's reference)."""
    return {
        "name": "postbox-capture-reference",
        "topic.prefix": topic_prefix,
        "table.include.list": ",".join(tables),
    }


# The JSON converter without schemas: the format postbox's change capture writes.
JSON_CONVERTERS = {
    "key.converter": "org.apache.kafka.connect.json.JsonConverter",
    "key.converter.schemas.enable": "false",
    "value.converter": "org.apache.kafka.connect.json.JsonConverter",
    "value.converter.schemas.enable": "false",
}
STRING_CONVERTERS = {
    "key.converter": "org.apache.kafka.connect.storage.StringConverter",
    "value.converter": "org.apache.kafka.connect.storage.StringConverter",
}


class DebeziumConnect:
    """One Kafka Connect standalone worker running one Debezium PostgreSQL connector on `tables`.

    The database must run with wal_level=logical. The publication is created here, the replication slot
    on first start (snapshot.mode=no_data: rows committed before that are not read, as with a new
    deployment); `close` removes both so the next run starts clean. The outbox is partitioned (migration
    0007): Debezium's documented setup for that is a publication created by hand with
    publish_via_partition_root, so every partition's rows reach it as the outbox's (its own "filtered"
    publication would name the parent, and the changes would arrive under the partitions' names, which
    table.include.list does not match).
    """

    def __init__(
        self,
        dsn: str,
        port: int,
        bootstrap: str,
        options: dict[str, str],
        *,
        converters: dict[str, str] = STRING_CONVERTERS,
        heap: str = "2G",
    ) -> None:
        libs = resolve_classpath(POM, f"debezium-{debezium_version()}")
        tables = options["table.include.list"].split(",")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP PUBLICATION IF EXISTS {SLOT}")
            listed = ", ".join(".".join(f'"{part}"' for part in table.split(".")) for table in tables)
            conn.execute(
                f"CREATE PUBLICATION {SLOT} FOR TABLE {listed} WITH (publish_via_partition_root = true)"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="postbox-debezium-"))
        self.rest_port = free_port()
        self.log_path = self.directory / "connect.log"
        worker = {
            "bootstrap.servers": bootstrap,
            "listeners": f"http://127.0.0.1:{self.rest_port}",
            "offset.storage.file.filename": str(self.directory / "offsets"),
            "offset.flush.interval.ms": "1000",
            **converters,
            "plugin.discovery": "only_scan",
            "producer.compression.type": "lz4",
            "producer.linger.ms": "5",
        }
        connector = {
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "tasks.max": "1",
            "database.hostname": "127.0.0.1",
            "database.port": str(port),
            "database.user": "postgres",
            "database.dbname": "postgres",
            "plugin.name": "pgoutput",
            "slot.name": SLOT,
            "publication.name": SLOT,
            "publication.autocreate.mode": "disabled",
            "snapshot.mode": "no_data",
            **options,
        }
        self.connector_name = connector["name"]
        worker_file = self.directory / "worker.properties"
        connector_file = self.directory / "connector.properties"
        worker_file.write_text("".join(f"{k}={v}\n" for k, v in worker.items()))
        connector_file.write_text("".join(f"{k}={v}\n" for k, v in connector.items()))
        (self.directory / "log4j2.properties").write_text(LOG4J2)
        java = shutil.which("java")
        assert java is not None, "Java is needed for Kafka Connect"
        # The JVM options connect-standalone.sh ships with (its default heap and G1 settings).
        command = [
            java,
            "-Xms256M",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true",
            f"-Dconnect.log={self.log_path}",
            f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
            "-cp",
            f"{libs}/*",
            "org.apache.kafka.connect.cli.ConnectStandalone",
            str(worker_file),
            str(connector_file),
        ]
        self._stdout = (self.directory / "stdout.log").open("ab")
        self.process = subprocess.Popen(
            command, stdout=self._stdout, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.process_id = self.process.pid

    def ready(self) -> bool:
        """The connector's task is RUNNING (it then streams from the slot it created)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"Kafka Connect exited {self.process.returncode}: {self.log_tail()}")
        url = f"http://127.0.0.1:{self.rest_port}/connectors/{self.connector_name}/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                status = json.load(response)
        except (OSError, urllib.error.URLError, ValueError):
            return False
        tasks = status.get("tasks", [])
        if any(task.get("state") == "FAILED" for task in tasks):
            raise RuntimeError(f"the Debezium task failed: {tasks[0].get('trace', '')[:3000]}")
        return status.get("connector", {}).get("state") == "RUNNING" and any(
            task.get("state") == "RUNNING" for task in tasks
        )

    def streaming(self, dsn: str) -> bool:
        """Ready, and its replication slot is in use."""
        if not self.ready():
            return False
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
            ).fetchone()
        return bool(row and row[0])

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def terminate(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def close(self, dsn: str) -> None:
        """Stop the worker, then drop its slot and publication (a leftover slot would pin WAL forever)."""
        self.terminate()
        self._stdout.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(50):
                row = conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
                ).fetchone()
                if row is None:
                    break
                if not row[0]:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
                    break
                time.sleep(0.2)
            conn.execute(f"DROP PUBLICATION IF EXISTS {SLOT}")
        shutil.rmtree(self.directory, ignore_errors=True)
