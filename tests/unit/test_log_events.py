"""Log events are a stable interface: names and keys are asserted here, and secrets and payloads never
appear in them."""

import asyncio
import json
from typing import Any

from prometheus_client import CollectorRegistry
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from postbox.inbox.webhooks.providers import Stripe, stripe_signature_header
from postbox.inbox.webhooks.receiver import ReceiverMetrics, WebhookReceiver
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import Delivery, decide

SECRET = "whsec_unit"
PAYLOAD_MARKER = "card-4242-secret-payload"


def call(app: WebhookReceiver, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def receiver(max_body: int = 4096) -> WebhookReceiver:
    # Never opened: every request below is refused before the database would be touched.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool("postgresql://unused", open=False)
    return WebhookReceiver(
        {"stripe": Stripe((SECRET,))},
        pool,
        ReceiverMetrics(CollectorRegistry()),
        max_body,
        clock=lambda: 1_800_000_000,
    )


def test_a_rejected_signature_is_logged_by_name_without_secret_or_payload() -> None:
    body = json.dumps({"id": "evt_1", "type": "charge.succeeded", "note": PAYLOAD_MARKER}).encode()
    with capture_logs() as logs:
        status, reply = call(
            receiver(),
            "/webhooks/stripe",
            body,
            {
                "content-type": "application/json",
                "stripe-signature": stripe_signature_header("whsec_wrong", body, 1_800_000_000),
            },
        )
    assert (status, reply) == (401, {"error": "signature verification failed"})
    assert logs == [
        {
            "event": "webhook_signature_rejected",
            "log_level": "warning",
            "provider": "stripe",
            "reason": "no Stripe v1 signature matches",
        }
    ]
    assert SECRET not in repr(logs)
    assert PAYLOAD_MARKER not in repr(logs)


def test_refusals_before_the_database_answer_clearly() -> None:
    app = receiver(max_body=1024)
    assert call(app, "/webhooks/stripe", b"{}", {"content-type": "text/plain"})[0] == 415
    assert call(app, "/webhooks/stripe", b"x" * 2048, {"content-type": "application/json"})[0] == 413
    assert call(app, "/webhooks/nobody", b"{}", {"content-type": "application/json"})[0] == 404
    body = b'{"id": "evt_1", "type":'
    status, reply = call(
        app,
        "/webhooks/stripe",
        body,
        {
            "content-type": "application/json",
            "stripe-signature": stripe_signature_header(SECRET, body, 1_800_000_000),
        },
    )
    assert status == 400
    assert "not JSON" in str(reply["error"])


def test_outcome_reasons_are_the_broker_errors_not_payloads() -> None:
    outcome = decide([1], ["a"], [Delivery(Disposition.PARK, "Broker: Message size too large")])
    assert outcome.rows[0].error == "Broker: Message size too large"
