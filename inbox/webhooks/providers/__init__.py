"""Signature verification and event extraction per provider, a module each. Pure: no I/O, no clock except as
passed in.

Every comparison of a signature uses hmac.compare_digest (constant time). Verification runs on the raw
body before anything is parsed or written.
"""

from __future__ import annotations

from postbox.inbox.webhooks.providers.base import (
    MAX_ID_BYTES,
    Headers,
    IncomingEvent,
    MalformedWebhook,
    Provider,
    SignatureError,
    any_matches,
    body_key,
    canonical_json,
    decode_text,
    hmac_digest,
    parse_json,
)
from postbox.inbox.webhooks.providers.generic import GenericHmac
from postbox.inbox.webhooks.providers.marqeta import Marqeta
from postbox.inbox.webhooks.providers.shopify import SHOPIFY_KEPT_HEADERS, Shopify
from postbox.inbox.webhooks.providers.stripe import Stripe, stripe_event, stripe_signature_header

__all__ = [
    "MAX_ID_BYTES",
    "SHOPIFY_KEPT_HEADERS",
    "GenericHmac",
    "Headers",
    "IncomingEvent",
    "MalformedWebhook",
    "Marqeta",
    "Provider",
    "Shopify",
    "SignatureError",
    "Stripe",
    "any_matches",
    "body_key",
    "canonical_json",
    "decode_text",
    "hmac_digest",
    "parse_json",
    "stripe_event",
    "stripe_signature_header",
]
