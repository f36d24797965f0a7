"""`postbox dev demo`: the relay on a real local PostgreSQL and Kafka, with sample traffic you can watch.

A writer commits an order row and its outbox event in one transaction a few times a second; the relay (a
real `postbox relay run` child process) publishes them; a plain Kafka consumer prints what arrives. At the
end the relay gets SIGTERM and the demo prints what was written, published and received.
"""

from __future__ import annotations

import json
import os
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

from relay.core.migrate import migrate
from relay.devstack.ports import free_port
from relay.devstack.stack import local_stack
from relay.outbox import enqueue

TOPIC = "outbox.event.order"


def _writer(dsn: str, schema: str, rate: float, stop: threading.Event, written: list[str]) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS demo_orders (id text PRIMARY KEY, total numeric, status text)"
        )
        conn.commit()
        n = 0
        while not stop.is_set():
            n += 1
            order_id = f"order-{n % 7}"  # a few aggregates, so per-key order is visible on the topic
            with conn.transaction():
                conn.execute(
                    "INSERT INTO demo_orders VALUES (%s, %s, 'placed') ON CONFLICT (id) DO UPDATE "
                    "SET total = EXCLUDED.total, status = 'updated'",
                    (order_id, n),
                )
                event_id = enqueue(
                    conn,
                    "order",
                    order_id,
                    "OrderChanged",
                    {"type": "OrderChanged", "order": order_id, "seq": n, "total": n},
                    headers={"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"},
                    schema=schema,
                )
            written.append(str(event_id))
            stop.wait(1 / rate)


def _consumer(bootstrap: str, stop: threading.Event, received: list[str]) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([TOPIC])
    try:
        while not stop.is_set():
            message = consumer.poll(0.2)
            if message is None or message.error():
                continue
            headers = dict(message.headers() or [])
            raw_id = headers.get("id")
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


def run_demo(duration: float, rate: float, schema: str = "postbox") -> int:
    print(
        "starting a real PostgreSQL and Kafka (first start fetches the Kafka jars with Maven)...", flush=True
    )
    with local_stack(publish_state=True) as (_, _, info):
        with psycopg.connect(info.database_url) as conn:
            migrate(conn, schema)
        print(f"PostgreSQL {info.postgres_version} at {info.database_url}")
        print(f"Kafka {info.kafka_version} at {info.kafka_bootstrap}")
        log_path = Path(tempfile.gettempdir()) / f"postbox-demo-relay-{os.getpid()}.log"
        metrics_port = free_port()
        relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay.cli",
                "--log-format",
                "json",
                "relay",
                "run",
                "--database-url",
                info.database_url,
                "--kafka-bootstrap",
                info.kafka_bootstrap,
                "--schema",
                schema,
                "--metrics-address",
                f"127.0.0.1:{metrics_port}",
            ],
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
        print(
            f"relay running (pid {relay.pid}); its JSON logs: {log_path}; metrics: "
            f"http://127.0.0.1:{metrics_port}/metrics"
        )
        print(f"writing {rate:g} orders/s, each with its outbox event in one transaction; consuming {TOPIC}:")
        writer_stop, stop = threading.Event(), threading.Event()
        written: list[str] = []
        received: list[str] = []
        threads = [
            threading.Thread(target=_writer, args=(info.database_url, schema, rate, writer_stop, written)),
            threading.Thread(target=_consumer, args=(info.kafka_bootstrap, stop, received)),
        ]
        for thread in threads:
            thread.start()
        interrupted = False
        try:
            deadline = time.monotonic() + duration if duration > 0 else float("inf")
            while time.monotonic() < deadline and relay.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            interrupted = True
        writer_stop.set()
        threads[0].join(timeout=10)
        # Let the last events through before judging.
        settle = time.monotonic() + 15
        while time.monotonic() < settle and not set(written) <= set(received) and relay.poll() is None:
            time.sleep(0.2)
        stop.set()
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(timeout=30)
        threads[1].join(timeout=10)
        lost = set(written) - set(received)
        print(
            f"\nwritten {len(written)}, received {len(received)} "
            f"({len(received) - len(set(received))} duplicates), missing {len(lost)}; "
            f"relay exited {code} after SIGTERM{' (interrupted)' if interrupted else ''}"
        )
        return 0 if code == 0 and not lost else 1
