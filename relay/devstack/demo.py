"""`postbox dev demo`: the relay and an inbox on a real local PostgreSQL and Kafka, with sample traffic.

A writer service commits an order row and its outbox event in one transaction a few times a second; the
relay (a real `postbox relay run` child process) publishes them; a plain Kafka consumer prints what arrives;
a downstream service (`postbox.inbox.example`, a real `postbox inbox consume` child process) applies each
event once to its own projection table. At the end both get SIGTERM and the demo prints what was written,
published, received and applied.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Consumer

from postbox.relay.core.db import DEFAULT_SCHEMA
from postbox.relay.devstack.ports import free_port
from postbox.relay.devstack.stack import StackInfo, local_stack
from postbox.relay.outbox import enqueue
from postbox.relay.outbox.admin import migrate_schema

TOPIC = "outbox.event.order"
AGGREGATES = 7  # a few orders, updated again and again, so per-key order is visible on the topic


def _writer(dsn: str, schema: str, rate: float, stop: threading.Event, written: list[str]) -> None:
    with psycopg.connect(dsn) as conn:
        n = 0
        while not stop.is_set():
            n += 1
            order_id = f"order-{n % AGGREGATES}"
            with conn.transaction():
                conn.execute(
                    "INSERT INTO demo_orders VALUES (%s, %s) "
                    "ON CONFLICT (id) DO UPDATE SET total = EXCLUDED.total",
                    (order_id, n),
                )
                event_id = enqueue(
                    conn,
                    "order",
                    order_id,
                    "OrderChanged",
                    {"order": order_id, "seq": n, "total": n},
                    headers={"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"},
                    schema=schema,
                )
            written.append(str(event_id))
            stop.wait(1 / rate)


def _watcher(bootstrap: str, stop: threading.Event, received: list[str]) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-watch-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([TOPIC])
    try:
        while not stop.is_set():
            message = consumer.poll(0.2)
            if message is None or message.error():
                continue
            raw_id = dict(message.headers() or []).get("id")
            event_id = raw_id.decode() if isinstance(raw_id, bytes) else "?"
            received.append(event_id)
            payload = json.loads(message.value() or b"null")
            print(
                f"  <- {message.topic()}[{message.partition()}]@{message.offset():<4} "
                f"key={(message.key() or b'').decode():8} id={event_id[:8]}… seq={payload.get('seq')}",
                flush=True,
            )
    finally:
        consumer.close()


def _child(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "postbox", "--log-format", "json", *args],
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )


def _applied(dsn: str) -> tuple[int, int, bool]:
    """(inbox claims, projection rows, whether every projection row holds its order's newest snapshot)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        claims = conn.execute(
            "SELECT count(*) FROM postbox.inbox_message "
            "WHERE consumer = 'orders-projection' AND status = 'done'"
        ).fetchone()
        rows = conn.execute(
            "SELECT count(*), bool_and(p.seq = o.total) FROM order_projection p "
            "JOIN demo_orders o ON o.id = p.order_id"
        ).fetchone()
    assert claims is not None
    assert rows is not None
    return int(claims[0]), int(rows[0]), bool(rows[1])


def _start_services(info: StackInfo, schema: str, logs: Path) -> tuple[subprocess.Popen[bytes], ...]:
    common = ["--database-url", info.database_url, "--kafka-bootstrap", info.kafka_bootstrap]
    relay = _child(
        [
            "relay",
            "run",
            *common,
            "--schema",
            schema,
            "--metrics-address",
            f"127.0.0.1:{free_port()}",
        ],
        logs / "relay.log",
    )
    inbox = _child(
        ["inbox", "consume", *common, "--app", "postbox.inbox.example:inbox", "--topics", TOPIC],
        logs / "inbox.log",
    )
    return relay, inbox


def run_demo(duration: float, rate: float, schema: str = DEFAULT_SCHEMA) -> int:
    print(
        "starting a real PostgreSQL and Kafka (first start fetches the Kafka jars with Maven)...", flush=True
    )
    with local_stack(publish_state=True, name="demo") as (_, _, info):
        with psycopg.connect(info.database_url, autocommit=True) as conn:
            migrate_schema(conn, schema, "log")  # as `postbox migrate` makes a new outbox
            conn.execute("CREATE TABLE demo_orders (id text PRIMARY KEY, total bigint)")
            conn.execute(
                "CREATE TABLE order_projection (order_id text PRIMARY KEY, total numeric, "
                "seq bigint NOT NULL)"
            )
        print(f"PostgreSQL {info.postgres_version} at {info.database_url}")
        print(f"Kafka {info.kafka_version} at {info.kafka_bootstrap}")
        logs = Path(tempfile.mkdtemp(prefix="postbox-demo-"))
        relay, inbox = _start_services(info, schema, logs)
        print(
            f"relay (pid {relay.pid}) and inbox consumer postbox.inbox.example (pid {inbox.pid}) running; "
            f"logs in {logs}"
        )
        print(f"writing {rate:g} orders/s, each with its outbox event in one transaction; watching {TOPIC}:")
        writer_stop, watcher_stop = threading.Event(), threading.Event()
        written: list[str] = []
        received: list[str] = []
        writer = threading.Thread(
            target=_writer, args=(info.database_url, schema, rate, writer_stop, written)
        )
        watcher = threading.Thread(target=_watcher, args=(info.kafka_bootstrap, watcher_stop, received))
        writer.start()
        watcher.start()
        try:
            deadline = time.monotonic() + duration if duration > 0 else float("inf")
            while time.monotonic() < deadline and relay.poll() is None and inbox.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        writer_stop.set()
        writer.join(timeout=10)
        settle = time.monotonic() + 20  # let the last events through before judging
        while (
            time.monotonic() < settle
            and relay.poll() is None
            and not (set(written) <= set(received) and _applied(info.database_url)[0] >= len(set(written)))
        ):
            time.sleep(0.2)
        watcher_stop.set()
        codes = []
        for child in (relay, inbox):
            child.send_signal(signal.SIGTERM)
            codes.append(child.wait(timeout=30))
        watcher.join(timeout=10)
        claims, projected, newest = _applied(info.database_url)
        missing = set(written) - set(received)
        print(
            f"\nwritten {len(written)}, received {len(received)} ({len(received) - len(set(received))} "
            f"duplicates), missing {len(missing)}; applied once by the inbox: {claims}; projection: "
            f"{projected} orders, newest snapshot everywhere: {newest}; relay exited {codes[0]}, "
            f"inbox exited {codes[1]} after SIGTERM"
        )
        ok = codes == [0, 0] and not missing and claims == len(set(written)) and newest
        return 0 if ok else 1
