"""What every provider shares: the event a webhook carries, the Provider protocol, errors, and pure helpers
(strict JSON, constant-time HMAC comparison, the body key). No I/O."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


def parse_json(body: bytes) -> Any:
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


def decode_text(body: bytes) -> str | None:
    """A body that parse_json accepted, as text for jsonb; None when only its parsed form can be stored (json
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


def hmac_digest(secret: bytes, body: bytes, algorithm: str = "sha256") -> bytes:
    return hmac.new(secret, body, algorithm).digest()


def any_matches(expected: Sequence[bytes], given: Sequence[bytes]) -> bool:
    # Check every pair (no early exit on the first match) so timing says nothing about which matched.
    found = False
    for mine in expected:
        for theirs in given:
            found |= hmac.compare_digest(mine, theirs)
    return found


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def body_key(body: bytes) -> str:
    """The second dedup key for a provider whose signature covers the body alone (Shopify, generic HMAC):
    the delivery id and topic headers are not signed, so a captured body replayed under a fresh id (or
    relabelled with another topic) must still be a duplicate of the body already stored."""
    return "body:" + hashlib.sha256(body).hexdigest()
