"""Signature verification and event extraction per provider. Pure: no I/O, no clock except as passed in.

Every comparison of a signature uses hmac.compare_digest (constant time). Verification runs on the raw
body before anything is parsed or written.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from postbox.inbox.message import IdSource, payload_field

Headers = Mapping[str, str]  # lower-cased names


class SignatureError(ValueError):
    """The request is not authentic: answer 401 and write nothing."""


class MalformedWebhook(ValueError):
    """The body or headers cannot be understood: answer 400 and write nothing."""


# An id or type longer than this is no provider's: refused with 400 before it reaches the primary key,
# whose B-tree entries PostgreSQL caps at about 2.7 kB (a longer one fails every retry the same way).
MAX_ID_BYTES = 512


@dataclass(frozen=True)
class IncomingEvent:
    provider: str
    event_id: str  # the provider's documented dedup id
    event_type: str
    payload: Any
    twin_key: str | None = None  # a second dedup layer (Stripe's twin events)
    headers: dict[str, str] = field(default_factory=dict)
    # The payload's JSON as the provider sent it, when it is the whole body: stored as it is (jsonb parses
    # it) rather than serialised again from Python, which cost time and rounded numbers through float
    # (an amount of 12345678901234567.89 stays exact in jsonb's numeric).
    payload_json: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for label, value in (("id", self.event_id), ("type", self.event_type)):
            if not value:
                raise MalformedWebhook(f"the event {label} is empty")
            if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
                raise MalformedWebhook(f"the event {label} is longer than {MAX_ID_BYTES} bytes")
        if (
            self.twin_key is not None
            and len(self.twin_key.encode("utf-8", "surrogatepass")) > 3 * MAX_ID_BYTES
        ):
            raise MalformedWebhook(f"the event's object id is longer than {MAX_ID_BYTES} bytes")


class Provider(Protocol):
    @property
    def name(self) -> str: ...

    def verify(self, headers: Headers, body: bytes, now: float) -> None:
        """Raise SignatureError unless the request is authentic."""
        ...

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        """The events the (verified) request carries; [] for a health check. Raise MalformedWebhook."""
        ...


def _refuse_constant(name: str) -> Any:
    raise MalformedWebhook(f"body holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedWebhook(f"body holds the number {text[:40]}, out of range for a double")
    return value


def _json(body: bytes) -> Any:
    """The body parsed, refusing what PostgreSQL's jsonb cannot store (so a signed but unstorable body is
    a 400, not a 500 on every retry): NaN and Infinity, numbers that overflow a double, and strings or
    keys holding NUL or a lone surrogate. Those two can only be written as \\u escapes (raw control bytes
    and invalid UTF-8 already fail to parse), so bodies without one skip the walk."""
    try:
        document = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedWebhook(f"body is not JSON: {exc}") from None
    except RecursionError:  # json's C parser gives up on very deep nesting this way
        raise MalformedWebhook("body is nested too deeply") from None
    if b"\\u" in body:
        _check_strings(document)
    return document


def _text(body: bytes) -> str | None:
    """A body that _json accepted, as text for jsonb; None when only its parsed form can be stored (json
    also reads UTF-16 and UTF-32, and a byte-order mark, which jsonb refuses)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if text.startswith("\ufeff") else text


def _check_strings(document: Any) -> None:
    stack = [document]
    while stack:  # iterative: the document may be nested as deeply as json's parser allows
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            if "\x00" in node:
                raise MalformedWebhook("body holds a NUL (\\u0000), which PostgreSQL cannot store")
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise MalformedWebhook("body holds a lone surrogate (invalid Unicode)") from None


def _hmac(secret: bytes, body: bytes, algorithm: str = "sha256") -> bytes:
    return hmac.new(secret, body, algorithm).digest()


def _any_matches(expected: Sequence[bytes], given: Sequence[bytes]) -> bool:
    # Check every pair (no early exit on the first match) so timing says nothing about which matched.
    found = False
    for mine in expected:
        for theirs in given:
            found |= hmac.compare_digest(mine, theirs)
    return found


# -- Stripe ---------------------------------------------------------------------------------------------


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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
        if not _any_matches([_hmac(s.encode(), signed) for s in self.secrets], signatures):
            raise SignatureError("no Stripe v1 signature matches")

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        return [stripe_event(_json(body), self.name, payload_json=_text(body))]


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
    signature = _hmac(secret.encode(), str(timestamp).encode() + b"." + body).hex()
    return f"t={timestamp},v1={signature}"


def body_key(body: bytes) -> str:
    """The second dedup key for a provider whose signature covers the body alone (Shopify, generic HMAC):
    the delivery id and topic headers are not signed, so a captured body replayed under a fresh id (or
    relabelled with another topic) must still be a duplicate of the body already stored."""
    return "body:" + hashlib.sha256(body).hexdigest()


# -- Shopify --------------------------------------------------------------------------------------------


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
        if not _any_matches([_hmac(s.encode(), body) for s in self.secrets], [signature]):
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
                _json(body),
                body_key(body),
                headers=kept,
                payload_json=_text(body),
            )
        ]


# -- Marqeta --------------------------------------------------------------------------------------------


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
        if not _any_matches([_hmac(self.secret.encode(), body, a) for a in self.algorithms], [signature]):
            raise SignatureError("X-Marqeta-Signature does not match")

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        document = _json(body)
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


# -- Generic HMAC ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenericHmac:
    """Any provider that signs the raw body with HMAC: the signature in `signature_header` (hex or
    base64, with an optional `sha256=`-style prefix), the id and type in a header or a payload field."""

    name: str
    secrets: tuple[str, ...]
    signature_header: str = "x-signature"
    algorithm: str = "sha256"
    encoding: str = "hex"
    id_from: str = "header:x-event-id"
    type_from: str = "payload:type"

    def __post_init__(self) -> None:
        if not self.secrets or not all(self.secrets):
            raise ValueError(f"{self.name}: at least one secret is required")
        if self.encoding not in ("hex", "base64"):
            raise ValueError(f"{self.name}: encoding is hex or base64")
        hashlib.new(self.algorithm)  # ValueError for an unknown algorithm
        for source in (self.id_from, self.type_from):
            try:
                IdSource.parse(source, allow_coordinates=False)
            except ValueError as exc:
                raise ValueError(f"{self.name}: {exc}") from None

    def verify(self, headers: Headers, body: bytes, now: float) -> None:
        # removeprefix, not a split on "=": a base64 signature ends in "=" padding (found by the fuzzer).
        value = headers.get(self.signature_header.lower(), "").removeprefix(f"{self.algorithm}=")
        try:
            signature = (
                bytes.fromhex(value) if self.encoding == "hex" else base64.b64decode(value, validate=True)
            )
        except (ValueError, binascii.Error):
            raise SignatureError(f"{self.signature_header} is not {self.encoding}") from None
        if not value or not _any_matches(
            [_hmac(s.encode(), body, self.algorithm) for s in self.secrets], [signature]
        ):
            raise SignatureError(f"{self.signature_header} does not match")

    def _pick(self, source: str, headers: Headers, payload: Any) -> str:
        where = IdSource.parse(source, allow_coordinates=False)
        if where.kind == "header":
            value: Any = headers.get(where.name.lower())
        else:
            value = payload_field(payload, where.name)
        if value is None or isinstance(value, dict | list) or str(value) == "":
            raise MalformedWebhook(f"{source} is missing")
        return str(value)

    def events(self, headers: Headers, body: bytes) -> list[IncomingEvent]:
        payload = _json(body)
        return [
            IncomingEvent(
                self.name,
                self._pick(self.id_from, headers, payload),
                self._pick(self.type_from, headers, payload),
                payload,
                body_key(body),
                payload_json=_text(body),
            )
        ]
