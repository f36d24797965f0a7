"""Marqeta: HMAC over the raw body and basic auth; a batch of notifications per request. Pure."""

from __future__ import annotations

import base64
import hmac
from dataclasses import dataclass

from postbox.inbox.webhooks.providers.base import (
    Headers,
    IncomingEvent,
    MalformedWebhook,
    SignatureError,
    any_matches,
    hmac_digest,
    parse_json,
)


@dataclass(frozen=True)
class Marqeta:
    """Basic Authentication (required by Marqeta) and, when a secret is set, `X-Marqeta-Signature`: the hex
    HMAC-SHA1 or HMAC-SHA256 of the raw body (both are accepted while an endpoint switches algorithm).

    A request batches up to 10 notifications of one type, in arrays keyed by type
    (`{"transactions": [{"token": ...}, ...]}`); each notification is an event, keyed by its token.
    """

    username: str
    password: str
    secret: str | None = None
    algorithms: tuple[str, ...] = ("sha256", "sha1")
    name: str = "marqeta"

    def __post_init__(self) -> None:
        if not self.username or not self.password:
            raise ValueError("marqeta: the Basic Authentication username and password are required")
        if not set(self.algorithms) <= {"sha1", "sha256"}:
            raise ValueError("marqeta: signature algorithms are sha1 and sha256")

    def verify(self, headers: Headers, body: bytes, now: float) -> None:
        expected = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        if not hmac.compare_digest(headers.get("authorization", "").encode(), f"Basic {expected}".encode()):
            raise SignatureError("Basic Authentication failed")
        if self.secret is None:
            return
        given = headers.get("x-marqeta-signature", "")
        try:
            signature = bytes.fromhex(given)
        except ValueError:
            raise SignatureError("X-Marqeta-Signature is not hex") from None
        if not any_matches(
            [hmac_digest(self.secret.encode(), body, a) for a in self.algorithms], [signature]
        ):
            raise SignatureError("X-Marqeta-Signature does not match")

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        document = parse_json(body)
        if not isinstance(document, dict) or not document:
            raise MalformedWebhook("a Marqeta notification body is an object of arrays")
        found: list[IncomingEvent] = []
        for kind, notifications in document.items():
            if kind == "pings":
                continue  # a health check: answer 200, store nothing
            if not isinstance(notifications, list):
                raise MalformedWebhook(f"Marqeta {kind!r} is not an array")
            for notification in notifications:
                if not isinstance(notification, dict) or not isinstance(notification.get("token"), str):
                    raise MalformedWebhook(f"a Marqeta {kind} notification has no token")
                event_type = notification.get("type")
                found.append(
                    IncomingEvent(
                        self.name,
                        f"{kind}:{notification['token']}",
                        f"{kind}.{event_type}" if isinstance(event_type, str) else kind,
                        notification,
                    )
                )
        return found
