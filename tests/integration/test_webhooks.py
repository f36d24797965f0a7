"""Webhooks end to end on real servers: `postbox inbox serve` (uvicorn), PostgreSQL, `postbox inbox work`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest

from postbox.inbox.webhooks.providers import stripe_signature_header
from postbox.inbox.webhooks.reconcile import StripeReconciler, reconcile
from postbox.relay.core.migrate import migrate
from postbox.relay.devstack.ports import free_port
from tests.apps.hooks import SCHEMA_SQL
from tests.support.probes import http_get, metric_value
from tests.support.processes import ReceiverProcess, WorkerProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until
from tests.support.webhooks import (
    MARQETA_AUTH,
    MARQETA_SECRET,
    SHOPIFY_SECRET,
    applied,
    stripe_body,
    stripe_headers,
    wait_settled,
)

Conn = psycopg.Connection[tuple[object, ...]]


def rows(db: Conn) -> list[tuple[object, ...]]:
    return db.execute("SELECT provider, event_id, status FROM webhook_inbox ORDER BY received_at").fetchall()


@pytest.fixture
def receiver(servers: Servers, schema: str) -> Any:
    with ReceiverProcess(servers.database_url, schema, "--max-body-bytes", "65536") as process:
        yield process


def test_replayed_and_concurrent_duplicates_are_stored_once(receiver: ReceiverProcess, db: Conn) -> None:
    body = stripe_body()
    results: list[tuple[int, dict[str, object]]] = []
    threads = [
        threading.Thread(target=lambda: results.append(receiver.post("stripe", body, stripe_headers(body))))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(status for status, _ in results) == [200] * 8, "a duplicate is acknowledged too"
    assert sum(int(str(r["accepted"])) for _, r in results) == 1
    assert receiver.post("stripe", body, stripe_headers(body)) == (200, {"accepted": 0, "duplicates": 1})
    assert len(rows(db)) == 1


def test_a_stripe_twin_event_is_caught_by_the_second_key(receiver: ReceiverProcess, db: Conn) -> None:
    first = json.loads(stripe_body())
    twin = {**first, "id": f"evt_{uuid.uuid4().hex}"}  # another event id, the same change of the same object
    for event in (first, twin):
        body = json.dumps(event).encode()
        status, _ = receiver.post("stripe", body, stripe_headers(body))
        assert status == 200
    assert [r[1] for r in rows(db)] == [first["id"]]


def test_shopify_dedups_on_the_webhook_id_and_on_the_signed_body(receiver: ReceiverProcess, db: Conn) -> None:
    body = b'{"id": 1001, "total_price": "49.99"}'
    other = b'{"id": 1002, "total_price": "5.00"}'
    # A retry of wh-1; wh-2, the same event delivered to a second subscription (Shopify: "several webhooks
    # for the same event, one per subscription", to be skipped as duplicates); then another event.
    for webhook_id, sent in (("wh-1", body), ("wh-1", body), ("wh-2", body), ("wh-3", other)):
        digest = base64.b64encode(hmac.new(SHOPIFY_SECRET.encode(), sent, hashlib.sha256).digest()).decode()
        headers = {
            "X-Shopify-Hmac-Sha256": digest,
            "X-Shopify-Webhook-Id": webhook_id,
            "X-Shopify-Topic": "orders/create",
            "X-Shopify-Event-Id": "same-event" if sent == body else "other-event",
        }
        assert receiver.post("shopify", sent, headers)[0] == 200
    assert sorted(str(r[1]) for r in rows(db)) == ["wh-1", "wh-3"]


def marqeta_post(receiver: ReceiverProcess, document: dict[str, Any]) -> tuple[int, dict[str, object]]:
    body = json.dumps(document).encode()
    auth = base64.b64encode(":".join(MARQETA_AUTH).encode()).decode()
    return receiver.post(
        "marqeta",
        body,
        {
            "Authorization": f"Basic {auth}",
            "X-Marqeta-Signature": hmac.new(MARQETA_SECRET.encode(), body, hashlib.sha256).hexdigest(),
        },
    )


def test_a_marqeta_batch_with_repeats_inside_it_is_stored_per_notification_in_one_go(
    receiver: ReceiverProcess, db: Conn
) -> None:
    batch = {
        "transactions": [
            {"token": "tx-1", "type": "authorization"},
            {"token": "tx-2", "type": "authorization"},
            {"token": "tx-1", "type": "authorization"},
        ]
    }
    assert marqeta_post(receiver, batch) == (200, {"accepted": 2, "duplicates": 1})
    again = {
        "transactions": [{"token": "tx-2", "type": "authorization"}, {"token": "tx-3", "type": "clearing"}]
    }
    assert marqeta_post(receiver, again) == (200, {"accepted": 1, "duplicates": 1})
    assert marqeta_post(receiver, {"pings": [{"token": "marqeta", "payload": "healthcheck"}]})[0] == 200
    assert sorted(str(r[1]) for r in rows(db)) == [
        "transactions:tx-1",
        "transactions:tx-2",
        "transactions:tx-3",
    ]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("tampered body", 401),
        ("stale timestamp", 401),
        ("no signature", 401),
        ("wrong secret", 401),
        ("oversized body", 413),
        ("malformed json", 400),
        ("wrong content type", 415),
        ("unknown provider", 404),
    ],
)
def test_bad_requests_are_refused_with_a_clear_status_and_nothing_written(
    receiver: ReceiverProcess, db: Conn, case: str, expected: int
) -> None:
    body = stripe_body()
    headers = stripe_headers(body)
    provider = "stripe"
    if case == "tampered body":
        body = body.replace(b"500", b"900")
    elif case == "stale timestamp":
        headers = stripe_headers(body, int(time.time()) - 3600)
    elif case == "no signature":
        headers = {}
    elif case == "wrong secret":
        headers = {"Stripe-Signature": stripe_signature_header("whsec_other", body, int(time.time()))}
    elif case == "oversized body":
        body = json.dumps({"id": "evt_big", "type": "x", "pad": "x" * 70_000}).encode()
        headers = stripe_headers(body)
    elif case == "malformed json":
        body = b'{"id": "evt_1", "type": '
        headers = stripe_headers(body)
    elif case == "wrong content type":
        headers = {**headers, "Content-Type": "text/plain"}
    elif case == "unknown provider":
        provider = "nobody"
    status, reply = receiver.post(provider, body, headers)
    assert status == expected
    assert "error" in reply
    assert rows(db) == []


def test_the_database_down_answers_503_and_the_retry_lands(own_postgres: Any) -> None:
    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
    from tests.support.probes import http_get  # noqa: PLC0415

    metrics_port = free_port()
    with ReceiverProcess(
        own_postgres.dsn, "postbox", "--metrics-address", f"127.0.0.1:{metrics_port}"
    ) as receiver:
        body = stripe_body()
        assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
        assert http_get(metrics_port, "/readyz")[0] == 200
        own_postgres.crash()
        retry = stripe_body()
        status, reply = receiver.post("stripe", retry, stripe_headers(retry))
        assert (status, reply) == (503, {"error": "temporarily unavailable, retry later"})
        # The metrics port's readiness is the database's too, not a constant "ok".
        wait_until(
            lambda: http_get(metrics_port, "/readyz")[0] == 503, 15, what="unready on the metrics port"
        )
        own_postgres.start_again()
        wait_until(lambda: http_get(metrics_port, "/readyz")[0] == 200, 30, what="ready again")
        wait_until(
            lambda: receiver.post("stripe", retry, stripe_headers(retry))[0] == 200,
            30,
            interval=0.5,
            what="the provider's retry accepted",
        )
        assert receiver.terminate() == 0
    with psycopg.connect(own_postgres.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM postbox.webhook_inbox").fetchone() == (2,)


def test_the_worker_is_unready_while_its_database_is_gone_and_ready_once_back(own_postgres: Any) -> None:
    from tests.support.probes import http_get  # noqa: PLC0415

    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate(conn, "postbox")
    with WorkerProcess(own_postgres.dsn, "postbox") as worker:
        wait_until(lambda: http_get(worker.metrics_port, "/readyz")[0] == 200, 30, what="ready")
        own_postgres.crash()
        wait_until(lambda: http_get(worker.metrics_port, "/readyz")[0] == 503, 30, what="unready")
        assert http_get(worker.metrics_port, "/healthz")[0] == 200, "alive: only not ready"
        own_postgres.start_again()
        wait_until(lambda: http_get(worker.metrics_port, "/readyz")[0] == 200, 60, what="ready again")
        assert worker.terminate() == 0


def test_a_worker_killed_mid_event_leaves_it_to_be_picked_up_again_and_applied_once(
    servers: Servers, schema: str, db: Conn, receiver: ReceiverProcess, tmp_path: Path
) -> None:
    db.execute(SCHEMA_SQL)
    bodies = [stripe_body() for _ in range(5)]
    for body in bodies:
        assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
    flag = tmp_path / "crashed"
    victim = WorkerProcess(servers.database_url, schema, env={"HOOKS_CRASH_FLAG": str(flag)})
    assert victim.process.wait(timeout=30) == -9
    killed_in = flag.read_text()
    state = db.execute("SELECT status FROM webhook_inbox WHERE event_id = %s", (killed_in,)).fetchone()
    assert state == ("processing",), "left behind by the dead worker"
    survivor = WorkerProcess(servers.database_url, schema)
    try:
        wait_until(
            lambda: len(applied(db)) == 5, 30, what="every event applied, the stuck one after the reaper"
        )
    finally:
        assert survivor.terminate() == 0
    assert all(count == 1 for _, count in applied(db)), "the killed attempt's write was rolled back"
    assert "webhook_event_reaped" in survivor.log()
    assert db.execute("SELECT attempts FROM webhook_inbox WHERE event_id = %s", (killed_in,)).fetchone() == (
        2,
    )


def test_a_poison_event_ends_failed_after_the_attempts_cap_and_the_rest_flow(
    servers: Servers, schema: str, db: Conn, receiver: ReceiverProcess
) -> None:
    db.execute(SCHEMA_SQL)
    poison = stripe_body("poison.event")
    good = stripe_body()
    for body in (poison, good):
        assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
    worker = WorkerProcess(servers.database_url, schema)
    try:
        wait_settled(db, 2)
    finally:
        assert worker.terminate() == 0
    poison_id = json.loads(poison)["id"]
    row = db.execute(
        "SELECT status, attempts, last_error FROM webhook_inbox WHERE event_id = %s", (poison_id,)
    ).fetchone()
    assert row == ("failed", 3, "RuntimeError: cannot be applied")
    assert applied(db) == [(json.loads(good)["id"], 1)], (
        "the poison's writes never stuck; the good one applied"
    )


def test_async_handlers_apply_an_event_once_and_a_failing_one_ends_failed_with_its_writes_undone(
    servers: Servers, schema: str, db: Conn, receiver: ReceiverProcess
) -> None:
    db.execute(SCHEMA_SQL)
    good, poison = stripe_body("invoice.async_paid"), stripe_body("async.poison")
    for body in (good, poison, good):  # the good one twice: stored once
        assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
    worker = WorkerProcess(servers.database_url, schema)
    try:
        wait_settled(db, 2)
    finally:
        assert worker.terminate() == 0
    row = db.execute(
        "SELECT status, attempts, last_error FROM webhook_inbox WHERE event_id = %s",
        (json.loads(poison)["id"],),
    ).fetchone()
    assert row == ("failed", 3, "RuntimeError: cannot be applied, asynchronously")
    assert applied(db) == [(json.loads(good)["id"], 1)], (
        "the async handler ran once; the poison's writes undone"
    )


class FakeStripeApi(BaseHTTPRequestHandler):
    """Stands in for Stripe's HTTP API (a third-party service, not one of our servers): GET /v1/events."""

    events: ClassVar[list[dict[str, Any]]] = []

    def do_GET(self) -> None:
        body = json.dumps(
            {"object": "list", "url": "/v1/events", "has_more": False, "data": self.events}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_reconciliation_with_the_stripe_library_adds_only_what_the_webhooks_missed(
    receiver: ReceiverProcess, db: Conn
) -> None:
    delivered = json.loads(stripe_body())
    missed = json.loads(stripe_body("customer.updated"))
    body = json.dumps(delivered).encode()
    assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
    FakeStripeApi.events = [delivered, missed]
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeStripeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reconciler = StripeReconciler(
            "sk_test_postbox", base_url=f"http://127.0.0.1:{server.server_address[1]}"
        )
        from datetime import UTC, datetime, timedelta  # noqa: PLC0415

        assert reconcile(db, reconciler, datetime.now(UTC) - timedelta(days=3)) == (2, 1)
    finally:
        server.shutdown()
    assert sorted(str(r[1]) for r in rows(db)) == sorted([delivered["id"], missed["id"]])


def test_requests_arriving_together_share_statements_and_each_gets_its_own_answer(
    servers: Servers, schema: str, db: Conn
) -> None:
    metrics_port = free_port()
    distinct = [stripe_body(event_id=f"evt_group_{i}") for i in range(120)]
    # Signed and valid JSON, but jsonb cannot hold the number: PostgreSQL refuses the statement holding it.
    refused = b'{"id": "evt_refused", "object": "event", "type": "invoice.paid", "n": 1e-20000}'
    bodies = [*distinct, *distinct[:40], refused]
    with (
        ReceiverProcess(
            servers.database_url, schema, "--metrics-address", f"127.0.0.1:{metrics_port}"
        ) as receiver,
        ThreadPoolExecutor(max_workers=48) as pool,
    ):
        answers = list(pool.map(lambda body: receiver.post("stripe", body, stripe_headers(body)), bodies))
        _, metrics = http_get(metrics_port, "/metrics")

    *stored, (refused_status, refused_answer) = answers
    assert refused_status == 400, refused_answer
    assert "22003" in str(refused_answer["error"]), "numeric out of range, said as such"
    assert {status for status, _ in stored} == {200}, "nobody else pays for the refused request"
    assert sum(int(str(a["accepted"])) for _, a in stored) == 120
    assert sum(int(str(a["duplicates"])) for _, a in stored) == 40
    ids = {row[0] for row in db.execute("SELECT event_id FROM webhook_inbox").fetchall()}
    assert ids == {json.loads(body)["id"] for body in distinct}
    statements = metric_value(metrics, "postbox_webhook_statement_events_count")
    assert 0 < statements < len(stored), "requests that arrived together shared statements"


def test_amounts_are_stored_exactly_as_the_provider_sent_them(receiver: ReceiverProcess, db: Conn) -> None:
    body = (
        b'{"id": "evt_exact", "object": "event", "type": "invoice.paid", '
        b'"data": {"object": {"id": "in_1", "amount": 12345678901234567.89, "rate": 0.1000}}}'
    )
    assert receiver.post("stripe", body, stripe_headers(body))[0] == 200
    stored = db.execute(
        "SELECT payload->'data'->'object'->>'amount', payload->'data'->'object'->>'rate' FROM webhook_inbox"
    ).fetchone()
    assert stored == ("12345678901234567.89", "0.1000"), "not rounded through a float"
