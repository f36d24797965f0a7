"""Webhooks as the providers send them to the test receiver: the signing secrets it is configured with
(STRIPE_SECRET, SHOPIFY_SECRET, MARQETA_AUTH, MARQETA_SECRET), a signed Stripe event (stripe_body,
stripe_headers), and what tests.apps.hooks did with them (wait_settled, applied)."""

from __future__ import annotations

import json
import time
import uuid

import psycopg

from postbox.inbox.webhooks.providers import stripe_signature_header
from tests.support.waiting import wait_until

Conn = psycopg.Connection[tuple[object, ...]]

STRIPE_SECRET = "whsec_postbox_tests"
SHOPIFY_SECRET = "shpss_postbox_tests"
MARQETA_AUTH = ("marqeta-user", "marqeta-password")
MARQETA_SECRET = "marqeta-signing-secret"


def stripe_body(event_type: str = "invoice.paid", event_id: str | None = None, amount: int = 500) -> bytes:
    return json.dumps(
        {
            "id": event_id or f"evt_{uuid.uuid4().hex}",
            "object": "event",
            "type": event_type,
            "data": {"object": {"id": f"in_{uuid.uuid4().hex[:10]}", "amount_paid": amount}},
        }
    ).encode()


def stripe_headers(body: bytes, timestamp: int | None = None) -> dict[str, str]:
    return {"Stripe-Signature": stripe_signature_header(STRIPE_SECRET, body, timestamp or int(time.time()))}


def wait_settled(db: Conn, events: int) -> None:
    """Until `events` webhook events are done or parked (failed)."""
    wait_until(
        lambda: (
            db.execute("SELECT count(*) FROM webhook_inbox WHERE status IN ('done', 'failed')").fetchone()
            == (events,)
        ),
        30,
        what=f"{events} events settled",
    )


def applied(db: Conn) -> list[tuple[object, ...]]:
    return db.execute("SELECT event_id, count(*) FROM applied GROUP BY event_id ORDER BY event_id").fetchall()
