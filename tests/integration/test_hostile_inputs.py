"""No single row, record or request can stop a daemon (real servers, real processes).

Each test puts hostile inputs beside ordinary ones and checks three things: the daemon keeps running (no
exit, no restart), every ordinary input flows, and every hostile one is parked or refused with its reason
(relay: a `failed` row; inbox: a `failed` message under its coordinates; webhooks: a counted 4xx with
nothing stored).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from postbox.inbox.webhooks.providers import stripe_signature_header
from postbox.relay.outbox import enqueue
from tests.support.database import outbox_states
from tests.support.kafka import create_topic, produce_with_headers, read_topic
from tests.support.modes import BOTH_MODES
from tests.support.probes import http_get, metric_value
from tests.support.processes import InboxProcess, ReceiverProcess, RelayProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until
from tests.support.webhooks import STRIPE_SECRET

Conn = psycopg.Connection[tuple[object, ...]]
MB = 1 << 20


def insert_raw(db: Conn, **columns: object) -> int:
    """An outbox row written as a hostile writer with INSERT would: any column, any value."""
    columns.setdefault("aggregate_id", "a-1")
    columns.setdefault("event_type", "Changed")
    names = ", ".join(columns)
    marks = ", ".join(["%s"] * len(columns))
    row = db.execute(f"INSERT INTO outbox ({names}) VALUES ({marks}) RETURNING id", list(columns.values()))
    found = row.fetchone()
    assert found is not None
    return int(str(found[0]))


def drained_or_exited(servers: Servers, schema: str, relay: RelayProcess, timeout: float) -> None:
    """Wait until nothing is pending, or the relay has exited (which the caller then reports)."""
    wait_until(
        lambda: (
            outbox_states(servers.database_url, schema).get("pending", 0) == 0
            or relay.process.poll() is not None
        ),
        timeout,
        what="the outbox drained",
    )


def parked_reasons(db: Conn) -> dict[int, str]:
    return {
        int(str(r[0])): str(r[1])
        for r in db.execute("SELECT id, last_error FROM outbox WHERE state = 'failed'").fetchall()
    }


@BOTH_MODES
def test_no_row_a_writer_can_insert_stops_the_relay_or_holds_back_the_rest(
    servers: Servers, schema: str, db: Conn, relay_mode: str
) -> None:
    kind = f"hostile{uuid.uuid4().hex[:6]}"
    good: list[str] = []

    def ordinary(n: int) -> None:
        for i in range(n):
            good.append(str(enqueue(db, kind, f"a-{i % 3}", "Changed", {"n": len(good)}, schema=schema)))

    ordinary(5)
    hostile = {
        "attempts at the integer limit": insert_raw(
            db, aggregate_type=kind, payload='{"n": "max"}', attempts=2_147_483_647
        ),
        "attempts at the negative limit": insert_raw(
            db, aggregate_type=kind, payload='{"n": "min"}', attempts=-2_147_483_648
        ),
        "created in the far future": insert_raw(db, aggregate_type=kind, payload="{}", created_at="infinity"),
        "created before time": insert_raw(db, aggregate_type=kind, payload="{}", created_at="-infinity"),
    }
    publishable = set(hostile.values())
    unpublishable = {
        "a slash in the topic": insert_raw(db, aggregate_type=kind, topic="a/b", payload="{}"),
        "a space in the topic": insert_raw(db, aggregate_type=kind, topic="with space", payload="{}"),
        "a 300-character topic": insert_raw(db, aggregate_type=kind, topic="t" * 300, payload="{}"),
        "a non-ASCII topic": insert_raw(db, aggregate_type=kind, topic="naïve", payload="{}"),
        "an internal topic": insert_raw(db, aggregate_type=kind, topic="__consumer_offsets", payload="{}"),
        "the topic '..'": insert_raw(db, aggregate_type=kind, topic="..", payload="{}"),
        "an empty aggregate type": insert_raw(db, aggregate_type="", payload="{}"),
        "a template field in the type": insert_raw(db, aggregate_type="{event_type}", payload="{}"),
        "a 2 MB key": insert_raw(db, aggregate_type=kind, aggregate_id="k" * (2 * MB), payload="{}"),
        "a 5 MB payload": insert_raw(db, aggregate_type=kind, payload=json.dumps({"blob": "x" * (5 * MB)})),
        "an empty header name": insert_raw(db, aggregate_type=kind, headers='{"": "x"}', payload="{}"),
        "a header that is no string": insert_raw(db, aggregate_type=kind, headers='{"n": 1}', payload="{}"),
    }
    ordinary(5)

    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        drained_or_exited(servers, schema, relay, 60)
        assert relay.process.poll() is None, "the relay exited:\n" + relay.log()[-3000:]
        status, text = http_get(relay.metrics_port, "/readyz")
        assert status == 200, text
        assert relay.terminate() == 0

    reasons = parked_reasons(db)
    assert set(reasons) == set(unpublishable.values()), reasons
    for label, row_id in unpublishable.items():
        assert reasons[row_id], label
    assert "not a legal Kafka topic name" in reasons[unpublishable["a slash in the topic"]]
    assert "internal topics" in reasons[unpublishable["an internal topic"]]
    assert "aggregate_type is empty" in reasons[unpublishable["an empty aggregate type"]]
    assert "message.max.bytes" in reasons[unpublishable["a 5 MB payload"]]
    assert "message.max.bytes" in reasons[unpublishable["a 2 MB key"]]
    states = dict(
        db.execute("SELECT id, state FROM outbox WHERE id = ANY(%s)", (list(publishable),)).fetchall()
    )
    # Queue mode marks each row published; log mode writes nothing to a row it publishes.
    assert set(states.values()) == {"published" if relay_mode == "queue" else "logged"}, states
    attempts = db.execute(
        "SELECT attempts FROM outbox WHERE id = %s", (hostile["attempts at the integer limit"],)
    )
    assert attempts.fetchone() == (2_147_483_647,), "saturates instead of overflowing the mark"
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=len(good) + 4)
    delivered = Counter(r.headers["id"].decode() for r in records)
    assert set(good) <= set(delivered), "every ordinary row was published"
    assert all(n == 1 for n in delivered.values()), "nothing was published twice"


# -- bounded memory ------------------------------------------------------------------------------------


@pytest.fixture
def memory_limit() -> Iterator[Path]:
    """A cgroup (v1 memory controller) with the shipped pod's limit, 256 MiB."""
    group = Path(f"/sys/fs/cgroup/memory/postbox-test-{uuid.uuid4().hex[:8]}")
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(256 * MB))
    yield group
    for pid in filter(None, (group / "cgroup.procs").read_text().split()):
        os.kill(int(pid), 9)
    wait_until(lambda: not (group / "cgroup.procs").read_text().split(), 10, what="the cgroup emptied")
    group.rmdir()


@BOTH_MODES
def test_the_relay_drains_large_rows_within_the_pods_memory_limit(
    servers: Servers, schema: str, db: Conn, memory_limit: Path
) -> None:
    kind = f"large{uuid.uuid4().hex[:6]}"
    blob = os.urandom(300_000).hex()  # 600 kB of JSON text that does not compress away
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT %s, 'a-' || (i %% 7), 'Big', jsonb_build_object('i', i, 'blob', %s::text) "
        "FROM generate_series(1, 150) AS i",
        (kind, blob),
    )
    huge = os.urandom(2_500_000).hex()  # 5 MB, over message.max.bytes: parked without being loaded
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT %s, 'h-' || i, 'Huge', jsonb_build_object('blob', %s::text) FROM generate_series(1, 60) AS i",
        (kind, huge),
    )
    # 150 x 0.6 MB + 60 x 5 MB = 390 MB in one claim of the default 1,000 rows, were it loaded whole.
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        (memory_limit / "cgroup.procs").write_text(str(relay.process.pid))
        drained_or_exited(servers, schema, relay, 120)
        peak = int((memory_limit / "memory.max_usage_in_bytes").read_text())
        assert relay.process.poll() is None, (
            f"the relay died (peak {peak / MB:.0f} MiB):\n{relay.log()[-2000:]}"
        )
        assert relay.terminate() == 0
    print(f"relay peak memory under the 256 MiB limit: {peak / MB:.0f} MiB")
    assert outbox_states(servers.database_url, schema) == {"published": 150, "failed": 60}
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=150)
    assert len({r.headers["id"] for r in records}) == 150


def test_the_inbox_consumer_applies_large_records_within_the_pods_memory_limit(
    servers: Servers, schema: str, db: Conn, memory_limit: Path
) -> None:
    topic = f"large-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 2)
    producer = Producer({"bootstrap.servers": servers.kafka_bootstrap, "enable.idempotence": True})
    for i in range(160):  # 160 x 0.9 MB of incompressible JSON: 144 MB on the topic
        value = json.dumps({"i": i, "blob": os.urandom(450_000).hex()}).encode()
        producer.produce(topic, value, f"k{i % 5}".encode(), headers=[("id", f"big-{i}".encode())])
        producer.poll(0)
    assert producer.flush(60) == 0
    with InboxProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        "tests.apps.noop:inbox",
        [topic],
        log_level="info",
    ) as inbox:
        (memory_limit / "cgroup.procs").write_text(str(inbox.process.pid))
        wait_until(
            lambda: (
                db.execute("SELECT count(*) FROM inbox_message").fetchone() == (160,)
                or inbox.process.poll() is not None
            ),
            120,
            what="every record claimed",
        )
        peak = int((memory_limit / "memory.max_usage_in_bytes").read_text())
        assert inbox.process.poll() is None, f"the consumer died (peak {peak / MB:.0f} MiB)"
        assert inbox.terminate() == 0
    print(f"inbox consumer peak memory under the 256 MiB limit: {peak / MB:.0f} MiB")
    assert db.execute("SELECT count(*) FROM inbox_message WHERE status = 'done'").fetchone() == (160,)


# -- leases --------------------------------------------------------------------------------------------


@BOTH_MODES
def test_a_second_replica_with_the_same_relay_id_waits_and_stopping_it_changes_nothing(
    servers: Servers, schema: str, db: Conn
) -> None:
    kind = f"sameid{uuid.uuid4().hex[:6]}"
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, relay_id="twin") as first:
        wait_until(lambda: http_get(first.metrics_port, "/readyz")[0] == 200, 30, what="first ready")
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, relay_id="twin") as second:
            wait_until(lambda: "relay_id_in_use" in second.log(), 30, what="the second refused")
            status, reason = http_get(second.metrics_port, "/readyz")
            assert status == 503
            assert "another relay is connected with relay-id 'twin'" in reason
            assert second.terminate() == 0
        owned = db.execute("SELECT count(*) FROM outbox_shard_lease WHERE owner = 'twin'").fetchone()
        assert owned == (64,), "stopping the second released none of the first's leases"
        ids = [str(enqueue(db, kind, f"a-{i % 5}", "Changed", {"i": i}, schema=schema)) for i in range(200)]
        records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=200)
        assert first.process.poll() is None
    assert Counter(r.headers["id"].decode() for r in records) == Counter(ids), "each once"


@BOTH_MODES
def test_a_stale_session_holding_our_relay_id_is_ended_and_the_relay_goes_on(
    servers: Servers, schema: str, db: Conn
) -> None:
    """A session left over from this replica (after a network cut the server still thinks it alive) holds
    the relay id's lock, and no replica of that id has heartbeaten: the relay ends that session, takes the
    lock once the backend has gone, and publishes."""
    from postbox.relay.core.db import advisory_key  # noqa: PLC0415

    kind = f"stale{uuid.uuid4().hex[:6]}"
    relay_id = f"stale-{uuid.uuid4().hex[:6]}"
    leftover = psycopg.connect(
        servers.database_url, autocommit=True, application_name=f"postbox-relay {relay_id}"
    )
    key = advisory_key("postbox.relay-id", f"{schema}:{relay_id}")
    leftover.execute("SELECT pg_advisory_lock(%s)", (key,))
    try:
        with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, relay_id=relay_id) as relay:
            wait_until(lambda: http_get(relay.metrics_port, "/readyz")[0] == 200, 30, what="the relay ready")
            assert "relay_stale_session_ended" in relay.log()
            assert "relay_id_in_use" not in relay.log(), "the lock was taken once the backend had gone"
            ids = [str(enqueue(db, kind, "a", "Changed", {"i": i}, schema=schema)) for i in range(20)]
            records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=20)
            assert relay.terminate() == 0
        assert [r.headers["id"].decode() for r in records] == ids
        assert _session_gone(leftover), "the leftover session was ended"
    finally:
        leftover.close()


def _session_gone(conn: Conn) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return True
    return False


@BOTH_MODES
def test_a_lease_lost_mid_drain_costs_at_most_the_batches_in_flight(
    servers: Servers, schema: str, db: Conn
) -> None:
    kind = f"lost{uuid.uuid4().hex[:6]}"
    batch, lanes, rows = 100, 2, 20_000
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT %s, 'a-' || (i %% 50), 'Changed', jsonb_build_object('i', i) FROM generate_series(1, %s) i",
        (kind, rows),
    )
    # A 30 s lease renews every 10 s: without the re-check after a fenced mark, the relay would go on
    # claiming, publishing and being fenced on shards it no longer holds until that renewal.
    with RelayProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        "--batch-size",
        str(batch),
        "--lanes",
        str(lanes),
        "--lease-ttl",
        "30",
    ) as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema).get("published", 0) >= 1_000,
            60,
            what="the drain under way",
        )
        # Every lease taken away at once (as a replica sharing the relay id released them on its stop).
        db.execute("UPDATE outbox_shard_lease SET owner = NULL, expires_at = NULL")
        wait_until(
            lambda: outbox_states(servers.database_url, schema).get("pending", 0) == 0,
            120,
            what="the outbox drained",
        )
        assert relay.terminate() == 0
        log = relay.log()
    records = read_topic(servers.kafka_bootstrap, f"outbox.event.{kind}", expected=rows)
    copies = Counter(r.headers["id"] for r in records)
    duplicates = len(records) - len(copies)
    assert "relay_mark_fenced" in log, "the leases really were lost mid-drain"
    assert duplicates <= batch * lanes, f"{duplicates} duplicates for one loss of every lease"
    assert len(copies) == rows, "nothing lost"


# -- the inbox consumer --------------------------------------------------------------------------------


def test_records_with_unusable_ids_or_no_handler_are_parked_and_the_rest_applied(
    servers: Servers, schema: str, bank: Conn
) -> None:
    db = bank
    topic = f"bank-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    deposit = json.dumps({"account": "acc", "amount": 1}).encode()
    sent: list[tuple[str, list[tuple[str, bytes]]]] = []
    hostile = {
        "a NUL in the id": [("id", b"bad\x00id"), ("eventType", b"Deposit")],
        "a 5,000-byte id": [("id", b"x" * 5000), ("eventType", b"Deposit")],
        "an id that is not UTF-8": [("id", b"\xff\xfe\xfd"), ("eventType", b"Deposit")],
        "no id": [("eventType", b"Deposit")],
        "an event type nobody handles": [("id", uuid.uuid4().hex.encode()), ("eventType", b"Nope")],
        "no event type": [("id", uuid.uuid4().hex.encode())],
    }
    for i in range(12):
        good_id = f"good-{i}"
        sent.append((good_id, [("id", good_id.encode()), ("eventType", b"Deposit")]))
        if i < len(hostile):
            label = list(hostile)[i]
            sent.append((label, hostile[label]))
    produce_with_headers(servers.kafka_bootstrap, topic, deposit, b"acc", [headers for _, headers in sent])

    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, "tests.apps.bank:inbox", [topic]
    ) as inbox:
        wait_until(
            lambda: (
                db.execute("SELECT count(*) FROM inbox_message").fetchone() == (len(sent),)
                or inbox.process.poll() is not None
            ),
            60,
            what="every record recorded",
        )
        assert inbox.process.poll() is None, "the consumer exited:\n" + inbox.log()[-3000:]
        assert inbox.terminate() == 0

    balance = db.execute("SELECT balance FROM accounts WHERE id = 'acc'").fetchone()
    assert balance == (12,), "every ordinary deposit applied once"
    parked = dict(
        db.execute("SELECT kafka_offset, error FROM inbox_message WHERE status = 'failed'").fetchall()
    )
    offsets = {label: offset for offset, (label, _) in enumerate(sent)}
    assert set(parked) == {offsets[label] for label in hostile}, parked
    assert "NUL" in str(parked[offsets["a NUL in the id"]])
    assert "over the 1024" in str(parked[offsets["a 5,000-byte id"]])
    assert "not UTF-8" in str(parked[offsets["an id that is not UTF-8"]])
    assert "no handler for event type 'Nope'" in str(parked[offsets["an event type nobody handles"]])
    assert "no handler for no event type" in str(parked[offsets["no event type"]])
    unusable = db.execute(
        "SELECT message_id FROM inbox_message WHERE kafka_offset = %s", (offsets["a NUL in the id"],)
    ).fetchone()
    assert unusable == (f"{topic}/0/{offsets['a NUL in the id']}",), "kept under its coordinates"


# -- the webhook receiver ------------------------------------------------------------------------------


@pytest.fixture
def receiver(servers: Servers, schema: str) -> Iterator[Any]:
    from postbox.relay.devstack.ports import free_port  # noqa: PLC0415

    port = free_port()
    with ReceiverProcess(servers.database_url, schema, "--metrics-address", f"127.0.0.1:{port}") as process:
        process.metrics_port = port  # type: ignore[attr-defined]
        yield process


def signed(body: bytes) -> dict[str, str]:
    return {"Stripe-Signature": stripe_signature_header(STRIPE_SECRET, body, int(time.time()))}


def test_signed_bodies_postgres_cannot_store_and_absurd_signatures_are_counted_4xx(
    receiver: Any, db: Conn
) -> None:
    secret_text = "payload-text-that-must-not-reach-the-logs"
    bodies = {
        "NUL": f'{{"id": "evt_nul", "type": "t", "note": "{secret_text}\\u0000"}}',
        "lone surrogate": f'{{"id": "evt_sur", "type": "t", "note": "{secret_text}\\ud800"}}',
        "NaN": f'{{"id": "evt_nan", "type": "t", "note": "{secret_text}", "n": NaN}}',
        "1e400": f'{{"id": "evt_big", "type": "t", "note": "{secret_text}", "n": 1e400}}',
        # a double (0.0) but past jsonb's numeric scale: PostgreSQL refuses it, the request alone gets 400
        "1e-20000": f'{{"id": "evt_tiny", "type": "t", "note": "{secret_text}", "n": 1e-20000}}',
        "a 3,000-byte id": json.dumps({"id": "e" * 3000, "type": "t", "note": secret_text}),
        "a 3,000-byte type": json.dumps({"id": "evt_type", "type": "t" * 3000}),
    }
    for label, text in bodies.items():
        body = text.encode()
        status, answer = receiver.post("stripe", body, signed(body))
        assert status == 400, (label, status, answer)
    absurd = {"Stripe-Signature": "t=" + "9" * 5000 + ",v1=" + "00" * 32}
    assert receiver.post("stripe", b"{}", absurd)[0] == 401
    absurd = {"Stripe-Signature": "t=99999999999999999999,v1=" + "00" * 32}
    assert receiver.post("stripe", b"{}", absurd)[0] == 401
    good = json.dumps({"id": "evt_good", "type": "t", "data": {"object": {"id": "o"}}}).encode()
    assert receiver.post("stripe", good, signed(good)) == (200, {"accepted": 1, "duplicates": 0})

    stored = db.execute("SELECT event_id FROM webhook_inbox").fetchall()
    assert stored == [("evt_good",)], "nothing of a refused request is stored"
    _, metrics = http_get(receiver.metrics_port, "/metrics")
    assert metric_value(metrics, "postbox_webhook_requests_total", provider="stripe", outcome="400") == 7
    assert metric_value(metrics, "postbox_webhook_requests_total", provider="stripe", outcome="401") == 2
    assert metric_value(metrics, "postbox_webhook_requests_total", provider="stripe", outcome="500") == 0
    assert secret_text not in receiver.log(), "no payload text in the logs"


# -- slow and idle clients -----------------------------------------------------------------------------


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_slow_and_idle_clients_neither_hold_the_receiver_nor_its_metrics_port(
    servers: Servers, schema: str, db: Conn
) -> None:
    import resource  # noqa: PLC0415
    import socket  # noqa: PLC0415

    from postbox.relay.devstack.ports import free_port  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the test itself holds ~2,500 sockets
    metrics_port = free_port()
    with ReceiverProcess(
        servers.database_url,
        schema,
        "--read-timeout",
        "2",
        "--metrics-address",
        f"127.0.0.1:{metrics_port}",
        log_level="info",
    ) as receiver:
        idle_webhook = [socket.create_connection(("127.0.0.1", receiver.port)) for _ in range(300)]
        idle_metrics = [socket.create_connection(("127.0.0.1", metrics_port)) for _ in range(2000)]
        slow_headers = socket.create_connection(("127.0.0.1", receiver.port))
        slow_body = socket.create_connection(("127.0.0.1", receiver.port))
        slow_body.sendall(
            b"POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        request = b"POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\n"
        started = time.monotonic()
        answered: list[float] = []
        for i in range(8):  # 4 s: a byte of headers every half second, a legitimate request meanwhile
            if i < 3:  # still inside the 2 s deadline; after it the server has closed the connection
                slow_headers.send(request[i : i + 1])
            began = time.monotonic()
            body = json.dumps({"id": f"evt_{i}_{uuid.uuid4().hex}", "type": "t"}).encode()
            assert receiver.post("stripe", body, signed(body))[0] == 200
            assert http_get(receiver.port, "/readyz")[0] == 200
            status, _ = http_get(metrics_port, "/metrics")
            assert status == 200
            answered.append(time.monotonic() - began)
            time.sleep(0.5)  # pacing, not waiting: the slow client's next byte half a second later
        assert time.monotonic() - started >= 4
        slow_headers.settimeout(5)
        assert slow_headers.recv(100).startswith(b"HTTP/1.1 408"), "cut off after the 2 s deadline"
        slow_body.settimeout(5)
        assert b" 408 " in slow_body.recv(200).split(b"\r\n", 1)[0]
        threads = _threads(receiver.process.pid)
        _, metrics = http_get(metrics_port, "/metrics")
        for sock in [*idle_webhook, *idle_metrics, slow_headers, slow_body]:
            sock.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(
        f"legitimate requests beside the slow clients: max {max(answered) * 1000:.0f} ms; threads {threads}"
    )
    assert max(answered) < 2.0, answered
    assert threads < 30, "no thread per connection"
    assert metric_value(metrics, "postbox_webhook_slow_clients_total") >= 301, "idle ones count too"
    assert metric_value(metrics, "postbox_webhook_requests_total", provider="stripe", outcome="408") == 1
    assert db.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (8,)


# -- replays the signature does not cover --------------------------------------------------------------


def test_a_replayed_shopify_body_under_a_new_delivery_id_or_topic_is_a_duplicate(
    receiver: Any, db: Conn
) -> None:
    import base64  # noqa: PLC0415
    import hashlib  # noqa: PLC0415
    import hmac  # noqa: PLC0415

    from tests.support.webhooks import SHOPIFY_SECRET  # noqa: PLC0415

    body = json.dumps({"id": 820982911946154508, "email": "jon@example.com", "total_price": "9.50"}).encode()
    signature = base64.b64encode(hmac.new(SHOPIFY_SECRET.encode(), body, hashlib.sha256).digest()).decode()

    def deliver(webhook_id: str, topic: str) -> tuple[int, dict[str, object]]:
        headers = {
            "X-Shopify-Hmac-Sha256": signature,
            "X-Shopify-Webhook-Id": webhook_id,
            "X-Shopify-Topic": topic,
        }
        return receiver.post("shopify", body, headers)  # type: ignore[no-any-return]

    assert deliver("wh-1", "orders/create") == (200, {"accepted": 1, "duplicates": 0})
    assert deliver("wh-1", "orders/create") == (200, {"accepted": 0, "duplicates": 1}), "a retry"
    assert deliver("wh-forged", "orders/create") == (200, {"accepted": 0, "duplicates": 1}), "a replay"
    assert deliver("wh-forged-2", "refunds/create") == (200, {"accepted": 0, "duplicates": 1}), "relabelled"
    stored = db.execute("SELECT event_id, event_type FROM webhook_inbox").fetchall()
    assert stored == [("wh-1", "orders/create")]


def test_a_flood_of_idle_sockets_past_the_descriptor_limit_leaves_legitimate_requests_answered(
    servers: Servers, schema: str, db: Conn
) -> None:
    """The receiver with only 300 file descriptors and 1,000 idle sockets thrown at it: the ones waiting
    longest are cut off to make room, so it never runs out of descriptors and requests keep getting 200."""
    import contextlib  # noqa: PLC0415
    import resource  # noqa: PLC0415
    import socket  # noqa: PLC0415

    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits[1], limits[1]))  # this test holds 1,000 sockets
    with ReceiverProcess(servers.database_url, schema, log_level="info", open_files=300) as receiver:
        idle: list[socket.socket] = []
        statuses: list[int] = []
        for round_ in range(10):
            for _ in range(100):
                # A full accept queue may refuse some: that is the kernel's doing, not a stuck receiver.
                with contextlib.suppress(OSError):
                    idle.append(socket.create_connection(("127.0.0.1", receiver.port), timeout=5))
            body = json.dumps({"id": f"evt_flood_{round_}", "type": "t"}).encode()
            statuses.append(receiver.post("stripe", body, signed(body))[0])
            statuses.append(http_get(receiver.port, "/readyz")[0])
        assert receiver.process.poll() is None
        log_bytes = receiver.log_path.stat().st_size
        for sock in idle:
            sock.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert statuses == [200] * 20, statuses
    assert db.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (10,)
    assert log_bytes < 200_000, f"the log grew {log_bytes} bytes"
