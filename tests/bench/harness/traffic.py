"""What the benchmarks write and read: payloads, a backlog of outbox rows committed at once (preload),
WRITERS connections committing one event per transaction at a fixed rate (paced_writes), and a plain
consumer that writes down when each event arrived (ReceiveTimes)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import confluent_kafka
import psycopg
from confluent_kafka import Consumer

from tests.bench.harness.servers import BenchServers

WRITERS = 4  # one connection commits at most ~2k single-row transactions/s here (fsync-bound)


def payload_of(size: int) -> str:
    # A JSON object of about `size` bytes once stored.
    return json.dumps({"order": "o-1", "status": "placed", "pad": "x" * max(0, size - 40)})


def preload(
    s: BenchServers, rows: int, payload: str, aggregate_type: str = "order", sampled_every: int | None = None
) -> float:
    """Commit `rows` outbox rows in one transaction; returns the wall time at which they became visible.
    With `sampled_every`, each row carries a writer's W3C traceparent (as enqueue stores it), one in
    `sampled_every` of them with the sampled flag."""
    traceparent = (
        "jsonb_build_object('traceparent', '00-' || md5(i::text) || '-' || left(md5('s' || i), 16) || '-' "
        "|| CASE WHEN i %% %s = 0 THEN '01' ELSE '00' END)"
    )
    headers = traceparent if sampled_every else "'{}'::jsonb"
    with psycopg.connect(s.postgres.dsn) as conn:
        conn.execute(
            "INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
            f"SELECT %s, 'o-' || (i %% 1000), 'Placed', %s::jsonb, {headers} "
            "FROM generate_series(1, %s) AS i",
            (aggregate_type, payload, *((sampled_every,) if sampled_every else ()), rows),
        )
        conn.commit()
        return time.perf_counter()


def writer_context(i: int, sampled_every: int | None) -> dict[str, str]:
    """The headers of event `i` of a traced writer (see preload), or none."""
    if not sampled_every:
        return {}
    flags = "01" if i % sampled_every == 0 else "00"
    return {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{flags}"}


def paced_writes(
    dsn: str, rate: float, seconds: float, write_one: Callable[[psycopg.Connection[Any], int], str]
) -> tuple[dict[str, float], float]:
    """WRITERS connections, each calling `write_one(conn, i)` (which commits one event and returns its id)
    at rate / WRITERS for `seconds`, i running over all writers' events. Returns when each event's commit
    returned (wall clock, by id) and how long the writers ran."""
    committed: dict[str, float] = {}

    def write(writer: int) -> None:
        with psycopg.connect(dsn) as conn:
            interval, next_at = WRITERS / rate, time.perf_counter()
            deadline, i = next_at + seconds, writer
            while time.perf_counter() < deadline:
                event_id = write_one(conn, i)
                committed[event_id] = time.time()
                i += WRITERS
                next_at += interval
                time.sleep(max(0.0, next_at - time.perf_counter()))

    writers = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    started = time.monotonic()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    return committed, time.monotonic() - started


class ReceiveTimes:
    """A plain consumer of `topic` (fetch.wait.max.ms 5, as a latency-minded consumer sets it) in a thread
    of its own: when each event arrived (wall clock), by the id `event_id` reads off the message. Entered
    once the consumer has its partitions (a broker just started can take seconds to load its group
    coordinator), so that the clock starts after that."""

    def __init__(
        self, bootstrap: str, topic: str, event_id: Callable[[confluent_kafka.Message], str]
    ) -> None:
        self.received: dict[str, float] = {}
        self._topic, self._event_id = topic, event_id
        self._stop, self._joined = threading.Event(), threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"latency-{uuid.uuid4().hex[:6]}",
                "auto.offset.reset": "earliest",  # a fresh topic: everything on it is this run's
                "fetch.wait.max.ms": 5,
                "fetch.min.bytes": 1,
            }
        )
        self._thread = threading.Thread(target=self._consume)

    def __enter__(self) -> ReceiveTimes:
        self._thread.start()
        if not self._joined.wait(60):
            self.__exit__()
            raise RuntimeError("the latency consumer got no partitions within 60 s")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._consumer.close()

    def _consume(self) -> None:
        self._consumer.subscribe([self._topic], on_assign=lambda *_: self._joined.set())
        while not self._stop.is_set():
            message = self._consumer.poll(0.05)
            if message is not None and not message.error():
                self.received[self._event_id(message)] = time.time()


def id_header(message: confluent_kafka.Message) -> str:
    """The event id a relay puts in each message's `id` header."""
    event_id = dict(message.headers() or [])["id"]
    assert isinstance(event_id, bytes)
    return event_id.decode()
