"""Which providers the receiver serves, from the environment. Pure apart from reading secret files.

POSTBOX_STRIPE_SECRETS         whsec_... (comma-separated while rotating), or POSTBOX_STRIPE_SECRETS_FILE
POSTBOX_STRIPE_TOLERANCE       seconds, default 300
POSTBOX_SHOPIFY_SECRETS        the app's client secret(s), or ..._FILE
POSTBOX_MARQETA_USERNAME / POSTBOX_MARQETA_PASSWORD (or ..._FILE)   Basic Authentication (required)
POSTBOX_MARQETA_SECRET         enables X-Marqeta-Signature checks; POSTBOX_MARQETA_ALGORITHMS=sha256,sha1
POSTBOX_WEBHOOK_GENERIC        names of generic HMAC providers, e.g. acme; then for each NAME:
    POSTBOX_WEBHOOK_<NAME>_SECRETS, _SIGNATURE_HEADER (x-signature), _ALGORITHM (sha256),
    _ENCODING (hex|base64), _ID_FROM (header:x-event-id), _TYPE_FROM (payload:type)
"""

from __future__ import annotations

import os

from inbox.webhooks.providers import GenericHmac, Marqeta, Provider, Shopify, Stripe
from relay.core.secrets import secret, secret_list


def providers_from_env(environ: dict[str, str] | None = None) -> dict[str, Provider]:
    env = dict(os.environ) if environ is None else environ
    found: dict[str, Provider] = {}
    if stripe := secret_list("POSTBOX_STRIPE_SECRETS", env):
        tolerance = env.get("POSTBOX_STRIPE_TOLERANCE", "300")
        try:
            seconds = float(tolerance)
        except ValueError:
            raise ValueError(f"POSTBOX_STRIPE_TOLERANCE={tolerance!r} is not a number of seconds") from None
        try:
            found["stripe"] = Stripe(stripe, seconds)
        except ValueError as exc:
            raise ValueError(f"POSTBOX_STRIPE_TOLERANCE={tolerance!r}: {exc}") from None
    if shopify := secret_list("POSTBOX_SHOPIFY_SECRETS", env):
        found["shopify"] = Shopify(shopify)
    username = env.get("POSTBOX_MARQETA_USERNAME")
    if username is not None:
        password = secret("POSTBOX_MARQETA_PASSWORD", env)
        if not password:
            raise ValueError("POSTBOX_MARQETA_PASSWORD is required with POSTBOX_MARQETA_USERNAME")
        algorithms = tuple(a.strip() for a in env.get("POSTBOX_MARQETA_ALGORITHMS", "sha256,sha1").split(","))
        try:
            found["marqeta"] = Marqeta(username, password, secret("POSTBOX_MARQETA_SECRET", env), algorithms)
        except ValueError as exc:
            raise ValueError(f"POSTBOX_MARQETA_*: {exc}") from None
    for name in filter(None, (n.strip() for n in env.get("POSTBOX_WEBHOOK_GENERIC", "").split(","))):
        prefix = f"POSTBOX_WEBHOOK_{name.upper().replace('-', '_')}"
        if name in found:
            raise ValueError(f"POSTBOX_WEBHOOK_GENERIC: {name!r} is already a built-in provider")
        options = {
            key: env[f"{prefix}_{key.upper()}"]
            for key in ("signature_header", "algorithm", "encoding", "id_from", "type_from")
            if f"{prefix}_{key.upper()}" in env
        }
        try:
            found[name] = GenericHmac(name, secret_list(f"{prefix}_SECRETS", env), **options)
        except ValueError as exc:
            raise ValueError(f"{prefix}_*: {exc}") from None
    if not found:
        raise ValueError(
            "no webhook provider is configured: set POSTBOX_STRIPE_SECRETS, POSTBOX_SHOPIFY_SECRETS, "
            "POSTBOX_MARQETA_USERNAME or POSTBOX_WEBHOOK_GENERIC"
        )
    return found
