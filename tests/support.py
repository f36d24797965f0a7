"""Helpers for tests that run real postbox processes against real servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from postbox.relay.devstack.ports import free_port


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


def read_topic(
    bootstrap: str, topic: str, expected: int, timeout: float = 60.0, settle: float = 1.0
) -> list[Record]:
    """Every message of `topic` from the beginning: waits for `expected`, then `settle` seconds for extras."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wait_until(lambda: topic in admin.list_topics(timeout=5).topics, timeout, what=f"topic {topic}")
    partitions = admin.list_topics(topic, timeout=5).topics[topic].partitions
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            if settle_until is None and len(records) >= expected:
                settle_until = time.monotonic() + settle
            if settle_until is not None and time.monotonic() >= settle_until:
                break
            for m in consumer.consume(500, timeout=0.2):
                if m.error():
                    continue
                records.append(
                    Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), dict(m.headers() or []))
                )
    finally:
        consumer.close()
    return records


REPO = Path(__file__).resolve().parents[1]


class ChildProcess:
    """A `postbox ...` command as a real child process (so SIGKILL, SIGSTOP and SIGTERM are the real thing),
    its JSON logs in a file under /tmp."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        log_level: str = "debug",
        open_files: int | None = None,
        program: tuple[str, ...] = (sys.executable, "-m", "postbox"),
        cwd: Path = REPO,
    ) -> None:
        self.log_path = Path(f"/tmp/postbox-test-{name}.log")
        self._log = self.log_path.open("ab")
        command = [*program, "--log-format", "json", "--log-level", log_level, *args]
        if open_files is not None:  # soft and hard limit both, so the process cannot raise it back
            command = ["prlimit", f"--nofile={open_files}:{open_files}", "--", *command]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def process_tree(self) -> list[int]:
        """This process's id and its descendants' (a receiver with --workers forks its workers)."""
        found, index = [self.process.pid], 0
        while index < len(found):
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{found[index]}/task").iterdir():
                    found.extend(int(c) for c in (task / "children").read_text().split())
            index += 1
        return found

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (after SIGCONT, in case it is paused) and its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


class RelayProcess(ChildProcess):
    """`postbox relay run` with short leases and polls, for tests."""

    def __init__(
        self,
        database_url: str,
        bootstrap: str,
        schema: str,
        *extra: str,
        relay_id: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.relay_id = relay_id or f"relay-{uuid.uuid4().hex[:6]}"
        self.metrics_port = free_port()
        super().__init__(
            f"{self.relay_id}-{uuid.uuid4().hex[:6]}",  # replicas may share a relay id, never a log
            [
                "relay",
                "run",
                "--database-url",
                database_url,
                "--kafka-bootstrap",
                bootstrap,
                "--schema",
                schema,
                "--relay-id",
                self.relay_id,
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                "--lease-ttl",
                "3",
                "--poll-interval",
                "0.2",
                *extra,
            ],
            env,
        )


def prepare_outbox(database_url: str, schema: str, mode: str = "queue") -> None:
    """Migrate `schema` and, for mode "log", switch its outbox to log mode."""
    import psycopg  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.migrate import migrate  # noqa: PLC0415
    from postbox.relay.outbox.admin import switch_mode  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate(conn, schema)
    if mode == "log":
        with connect(database_url, schema) as conn:
            switch_mode(conn, schema, "log")


def followed_modes(relay: RelayProcess) -> list[str]:
    """The modes a relay started with --mode auto ran in, in order (its relay_mode_followed events)."""
    import json  # noqa: PLC0415

    lines = relay.log().splitlines()
    return [str(json.loads(line)["mode"]) for line in lines if "relay_mode_followed" in line]


def outbox_states(database_url: str, schema: str) -> dict[str, int]:
    """Rows per state, in either mode: a logged row (log mode) counts as published once its shard's cursor
    has passed it (visible in the snapshot of the cursor's tick, or at or below last_id in the window the
    cursor is reading), as pending before."""
    import psycopg  # noqa: PLC0415

    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            f"""
            SELECT CASE WHEN o.state <> 'logged' THEN o.state
                        WHEN pg_visible_in_snapshot(o.txid, t.snapshot) THEN 'published'
                        WHEN o.id <= c.last_id AND pg_visible_in_snapshot(o.txid, w.snapshot) THEN 'published'
                        ELSE 'pending' END,
                   count(*)
            FROM "{schema}".outbox AS o
            LEFT JOIN "{schema}".outbox_cursor AS c ON c.shard = o.shard
            LEFT JOIN "{schema}".outbox_tick AS t ON t.tick = c.tick
            LEFT JOIN "{schema}".outbox_tick AS w ON w.tick = c.window_to
            GROUP BY 1"""
        ).fetchall()
    return {str(state): int(count) for state, count in rows}


def check_delivery(records: list[Record], written: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Assert the checker finds nothing broken: every committed event arrived, duplicates are identical
    copies, per-aggregate order holds. Returns counts for the report."""
    from tests.chaos.checker import check  # noqa: PLC0415

    report = check(written, records)
    assert report.ok, "\n".join(
        [*report.lines(), f"lost e.g. {report.lost[:3]}", f"inversions e.g. {report.inversions[:5]}"]
    )
    return {"events": report.written, "duplicates": report.duplicates}


class InboxProcess(ChildProcess):
    """`postbox inbox consume` with a test app."""

    def __init__(
        self,
        database_url: str,
        bootstrap: str,
        schema: str,
        app: str,
        topics: list[str],
        *extra: str,
        env: dict[str, str] | None = None,
        log_level: str = "debug",
    ) -> None:
        self.metrics_port = free_port()
        super().__init__(
            f"inbox-{uuid.uuid4().hex[:6]}",
            [
                "inbox",
                "consume",
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                "--app",
                app,
                "--database-url",
                database_url,
                "--kafka-bootstrap",
                bootstrap,
                "--schema",
                schema,
                "--topics",
                ",".join(topics),
                # A killed member leaves the group after this (Kafka's default is 45 s).
                "--kafka-config",
                "session.timeout.ms=6000",
                *extra,
            ],
            env,
            log_level,
        )


class WorkerProcess(ChildProcess):
    """`postbox inbox work` with the test webhook app, reaping quickly."""

    def __init__(self, database_url: str, schema: str, env: dict[str, str] | None = None) -> None:
        self.metrics_port = free_port()
        super().__init__(
            f"worker-{uuid.uuid4().hex[:6]}",
            [
                "inbox",
                "work",
                "--app",
                "tests.apps.hooks:hooks",
                "--database-url",
                database_url,
                "--schema",
                schema,
                "--poll-interval",
                "0.1",
                "--reap-interval",
                "0.5",
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
            ],
            env,
        )


def produce(
    bootstrap: str, topic: str, messages: list[tuple[str, str, dict[str, object]]], key: str | None = None
) -> None:
    """(message id, event type, payload) triples, as the relay would send them (plus an eventType header)."""
    import json  # noqa: PLC0415

    from confluent_kafka import Producer  # noqa: PLC0415

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
        }
    )
    errors: list[object] = []
    for message_id, event_type, payload in messages:
        producer.produce(
            topic,
            json.dumps(payload).encode(),
            (key or str(payload.get("account", "k"))).encode(),
            headers=[("id", message_id.encode()), ("eventType", event_type.encode())],
            on_delivery=lambda err, _m: errors.append(err) if err else None,
        )
    assert producer.flush(30) == 0
    assert not errors, errors


def create_topic(bootstrap: str, topic: str, partitions: int, replication: int = 1) -> None:
    from confluent_kafka.admin import NewTopic  # noqa: PLC0415

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the future resolves
    admin.create_topics([NewTopic(topic, partitions, replication)])[topic].result(30)


STRIPE_SECRET = "whsec_postbox_tests"
SHOPIFY_SECRET = "shpss_postbox_tests"
MARQETA_AUTH = ("marqeta-user", "marqeta-password")
MARQETA_SECRET = "marqeta-signing-secret"


class ReceiverProcess(ChildProcess):
    """`postbox inbox serve` (uvicorn), with the test providers configured, once it answers."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *extra: str,
        log_level: str = "debug",
        open_files: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **(env or {}),
            "POSTBOX_WEBHOOK_STRIPE_SECRETS": STRIPE_SECRET,
            "POSTBOX_WEBHOOK_SHOPIFY_SECRETS": SHOPIFY_SECRET,
            "POSTBOX_WEBHOOK_MARQETA_USERNAME": MARQETA_AUTH[0],
            "POSTBOX_WEBHOOK_MARQETA_PASSWORD": MARQETA_AUTH[1],
            "POSTBOX_WEBHOOK_MARQETA_SECRET": MARQETA_SECRET,
        }
        super().__init__(
            f"receiver-{self.port}",
            [
                "inbox",
                "serve",
                "--database-url",
                database_url,
                "--schema",
                schema,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            env,
            log_level,
            open_files,
        )
        wait_until(lambda: self.process.poll() is not None or self._answers(), 30, what="the receiver")
        assert self.process.poll() is None, self.log()

    def serving_pids(self) -> list[int]:
        """The processes that serve requests: this one, or with --workers the ones it started
        (multiprocessing's spawn; its resource tracker, also a child, serves nothing)."""
        started = []
        for pid in self.process_tree()[1:]:
            with contextlib.suppress(OSError):  # gone since the listing
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    started.append(pid)
        return started or [self.process.pid]

    def _answers(self) -> bool:
        import urllib.request  # noqa: PLC0415

        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def post(self, provider: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
        import json  # noqa: PLC0415
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        request = urllib.request.Request(
            f"{self.url}/webhooks/{provider}",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; a non-2xx answer is returned, not raised, and
    status 0 means nothing answered."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:  # not listening (yet), reset, timed out
        return 0, str(error)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus exposition text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        found = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if metric == name and found == wanted:
            return float(value)
    return 0.0


def execute_script(conn: Any, script: str) -> None:
    """Run each `;`-separated statement of `script` (the test apps' SCHEMA_SQL) on `conn`."""
    for statement in filter(str.strip, script.split(";")):
        conn.execute(statement)


def produce_with_headers(
    bootstrap: str, topic: str, value: bytes, key: bytes, headers: list[list[tuple[str, bytes]]]
) -> None:
    """One record per entry of `headers`, each with exactly those headers (hostile ones too), in order."""
    from confluent_kafka import Producer  # noqa: PLC0415

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for record_headers in headers:
        producer.produce(topic, value, key, headers=record_headers)
    assert producer.flush(30) == 0


def inbox_cli(
    servers: Any, schema: str, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`postbox inbox ARGS` on the test's schema, as a user runs it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "postbox",
            "inbox",
            *args,
            "--database-url",
            servers.database_url,
            "--schema",
            schema,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=check,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
