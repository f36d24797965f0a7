"""Stripe: `Stripe-Signature: t=...,v1=...` over `t.body`, with a tolerance for the timestamp. Pure."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from postbox.inbox.webhooks.providers.base import (
    Headers,
    IncomingEvent,
    MalformedWebhook,
    SignatureError,
    any_matches,
    canonical_json,
    decode_text,
    hmac_digest,
    parse_json,
)


@dataclass(frozen=True)
class Stripe:
    """`Stripe-Signature: t=<unix time>,v1=<hex hmac>[,v1=...]` over `<t>.<raw body>`.

    Several v1 signatures appear while Stripe rolls an endpoint secret; several configured secrets let
    the receiver roll its own. Timestamps outside the tolerance are refused (replay protection).
    """

    secrets: tuple[str, ...]
    tolerance: float = 300.0
    name: str = "stripe"

    def __post_init__(self) -> None:
        if not self.secrets or not all(self.secrets):
            raise ValueError("stripe: at least one endpoint secret (whsec_...) is required")
        # Finite and at most a day: inf or 1e12 would let a years-old captured request verify.
        if not (math.isfinite(self.tolerance) and 1 <= self.tolerance <= 86_400):
            raise ValueError(f"stripe: tolerance {self.tolerance!r}s is outside 1..86400")

    def verify(self, headers: Headers, body: bytes, now: float) -> None:
        header = headers.get("stripe-signature")
        if not header:
            raise SignatureError("missing Stripe-Signature header")
        timestamp: str | None = None
        signatures: list[bytes] = []
        for item in header.split(","):
            key, _, value = item.strip().partition("=")
            if key == "t":
                timestamp = value
            elif key == "v1":
                try:
                    signatures.append(bytes.fromhex(value))
                except ValueError:
                    continue
        # isascii: "²" and other Unicode digits pass isdigit() but int() refuses them. At most 12 digits:
        # the arithmetic below runs before any signature check, so anyone can send t=<10,000 digits>.
        if (
            timestamp is None
            or not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 12)
            or not signatures
        ):
            raise SignatureError("Stripe-Signature has no timestamp or no v1 signature")
        if abs(now - int(timestamp)) > self.tolerance:
            raise SignatureError(f"Stripe-Signature timestamp is outside the {self.tolerance:.0f}s tolerance")
        signed = timestamp.encode() + b"." + body
        if not any_matches([hmac_digest(s.encode(), signed) for s in self.secrets], signatures):
            raise SignatureError("no Stripe v1 signature matches")

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        return [stripe_event(parse_json(body), self.name, payload_json=decode_text(body))]


def stripe_event(event: Any, provider: str = "stripe", payload_json: str | None = None) -> IncomingEvent:
    """An inbox row for one Stripe Event object (from a webhook or from the API)."""
    if (
        not isinstance(event, dict)
        or not isinstance(event.get("id"), str)
        or not isinstance(event.get("type"), str)
    ):
        raise MalformedWebhook("a Stripe event needs string 'id' and 'type'")
    obj = (event.get("data") or {}).get("object")
    twin = None
    if isinstance(obj, dict) and isinstance(obj.get("id"), str):
        # Stripe's twin events share data.object's id and the event type but not the event id. A later,
        # different change to the same object shares both as well, so the object's content is part of
        # the key: only a second event for the same change of the same object is a twin.
        digest = hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:32]
        twin = f"{event['type']}:{obj['id']}:{digest}"
    return IncomingEvent(provider, event["id"], event["type"], event, twin, payload_json=payload_json)


def stripe_signature_header(secret: str, body: bytes, timestamp: int) -> str:
    """The header Stripe would send (for tests and for replaying captured events)."""
    signature = hmac_digest(secret.encode(), str(timestamp).encode() + b"." + body).hex()
    return f"t={timestamp},v1={signature}"
