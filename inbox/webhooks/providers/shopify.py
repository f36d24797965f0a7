"""Shopify: `X-Shopify-Hmac-Sha256` over the raw body; dedup on the delivery and on the body. Pure."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from postbox.inbox.webhooks.providers.base import (
    Headers,
    IncomingEvent,
    MalformedWebhook,
    SignatureError,
    any_matches,
    body_key,
    decode_text,
    hmac_digest,
    parse_json,
)

SHOPIFY_KEPT_HEADERS = (
    "x-shopify-topic",
    "x-shopify-shop-domain",
    "x-shopify-event-id",
    "x-shopify-triggered-at",
    "x-shopify-api-version",
)


@dataclass(frozen=True)
class Shopify:
    """`X-Shopify-Hmac-Sha256: base64(hmac_sha256(secret, raw body))`; dedup on X-Shopify-Webhook-Id
    (a delivery), not X-Shopify-Event-Id (shared by deliveries to different subscriptions), and on the
    body, which is all the signature covers (see body_key)."""

    secrets: tuple[str, ...]
    name: str = "shopify"

    def __post_init__(self) -> None:
        if not self.secrets or not all(self.secrets):
            raise ValueError("shopify: at least one app client secret is required")

    def verify(self, headers: Headers, body: bytes, now: float) -> None:
        given = headers.get("x-shopify-hmac-sha256")
        if not given:
            raise SignatureError("missing X-Shopify-Hmac-Sha256 header")
        try:
            signature = base64.b64decode(given, validate=True)
        except (binascii.Error, ValueError):
            raise SignatureError("X-Shopify-Hmac-Sha256 is not base64") from None
        if not any_matches([hmac_digest(s.encode(), body) for s in self.secrets], [signature]):
            raise SignatureError("X-Shopify-Hmac-Sha256 does not match")

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        webhook_id, topic = headers.get("x-shopify-webhook-id"), headers.get("x-shopify-topic")
        if not webhook_id or not topic:
            raise MalformedWebhook("X-Shopify-Webhook-Id and X-Shopify-Topic are required")
        kept = {name: headers[name] for name in SHOPIFY_KEPT_HEADERS if name in headers}
        return [
            IncomingEvent(
                self.name,
                webhook_id,
                topic,
                parse_json(body),
                body_key(body),
                headers=kept,
                payload_json=decode_text(body),
            )
        ]
