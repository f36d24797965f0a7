"""Any provider that signs the raw body with HMAC, configured by headers and payload paths. Pure."""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

from postbox.inbox.message import IdSource, payload_field
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
        if not value or not any_matches(
            [hmac_digest(s.encode(), body, self.algorithm) for s in self.secrets], [signature]
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
        payload = parse_json(body)
        return [
            IncomingEvent(
                self.name,
                self._pick(self.id_from, headers, payload),
                self._pick(self.type_from, headers, payload),
                payload,
                body_key(body),
                payload_json=decode_text(body),
            )
        ]
