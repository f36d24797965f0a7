"""Which providers the receiver serves. Pure apart from reading secret files.

The built-in providers are declared settings (POSTBOX_WEBHOOK_STRIPE_SECRETS...; the earlier
POSTBOX_STRIPE_SECRETS names are read for one more release). Generic HMAC providers are a family named by
POSTBOX_WEBHOOK_GENERIC, e.g. acme; then for each NAME:
    POSTBOX_WEBHOOK_<NAME>_SECRETS (or _FILE), _SIGNATURE_HEADER (x-signature), _ALGORITHM (sha256),
    _ENCODING (hex|base64), _ID_FROM (header:x-event-id), _TYPE_FROM (payload:type)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from postbox.inbox.webhooks.providers import GenericHmac, Marqeta, Provider, Shopify, Stripe
from postbox.relay.core.secrets import comma_list, secret_list
from postbox.relay.core.settings import (
    MissingSetting,
    Renamed,
    Settings,
    SettingsError,
    load,
    setting,
)
from postbox.relay.core.settings import secret_list as secrets


@dataclass(frozen=True, kw_only=True)
class ProviderSettings(Settings):
    """The webhook providers the receiver verifies."""

    PREFIX: ClassVar[str] = "POSTBOX_WEBHOOK_"

    stripe_secrets: tuple[str, ...] = setting(
        (),
        "Stripe endpoint signing secrets (whsec_...), comma-separated while rolling one",
        parse=secrets,
        secret=True,
        renamed=(Renamed("POSTBOX_STRIPE_SECRETS"),),
    )
    stripe_tolerance: float = setting(
        300.0,
        "seconds a Stripe signature's timestamp may be from now",
        bounds=(1, 86_400),
        renamed=(Renamed("POSTBOX_STRIPE_TOLERANCE"),),
    )
    shopify_secrets: tuple[str, ...] = setting(
        (),
        "Shopify app client secrets, comma-separated while rolling one",
        parse=secrets,
        secret=True,
        renamed=(Renamed("POSTBOX_SHOPIFY_SECRETS"),),
    )
    marqeta_username: str | None = setting(
        None,
        "Marqeta webhook Basic Authentication user (enables Marqeta)",
        parse=str,
        renamed=(Renamed("POSTBOX_MARQETA_USERNAME"),),
    )
    marqeta_password: str | None = setting(
        None,
        "Marqeta Basic Authentication password",
        parse=str,
        secret=True,
        renamed=(Renamed("POSTBOX_MARQETA_PASSWORD"),),
    )
    marqeta_secret: str | None = setting(
        None,
        "Marqeta X-Marqeta-Signature secret (checked when set)",
        parse=str,
        secret=True,
        renamed=(Renamed("POSTBOX_MARQETA_SECRET"),),
    )
    marqeta_algorithms: tuple[str, ...] = setting(
        ("sha256", "sha1"),
        "X-Marqeta-Signature algorithms accepted",
        parse=comma_list,
        shown_default="sha256,sha1",
        renamed=(Renamed("POSTBOX_MARQETA_ALGORITHMS"),),
    )
    generic: tuple[str, ...] = setting(
        (),
        "names of generic HMAC providers (each configured by POSTBOX_WEBHOOK_<NAME>_*)",
        parse=comma_list,
    )

    def check(self) -> None:
        if self.marqeta_username is not None and not self.marqeta_password:
            # Half a provider is a mistake, not "not configured": refused even when no service was named.
            raise SettingsError(f"{self.label('marqeta_password')}: required with --marqeta-username")
        if not (self.stripe_secrets or self.shopify_secrets or self.marqeta_username or self.generic):
            raise MissingSetting(
                "no webhook provider is configured: set POSTBOX_WEBHOOK_STRIPE_SECRETS, "
                "POSTBOX_WEBHOOK_SHOPIFY_SECRETS, POSTBOX_WEBHOOK_MARQETA_USERNAME or POSTBOX_WEBHOOK_GENERIC"
            )


def providers_from(settings: ProviderSettings, environ: Mapping[str, str]) -> dict[str, Provider]:
    """The providers `settings` configure; the generic ones read their family of variables from environ."""
    found: dict[str, Provider] = {}
    if settings.stripe_secrets:
        found["stripe"] = Stripe(settings.stripe_secrets, settings.stripe_tolerance)
    if settings.shopify_secrets:
        found["shopify"] = Shopify(settings.shopify_secrets)
    if settings.marqeta_username is not None:
        assert settings.marqeta_password is not None  # ProviderSettings.check
        try:
            found["marqeta"] = Marqeta(
                settings.marqeta_username,
                settings.marqeta_password,
                settings.marqeta_secret,
                settings.marqeta_algorithms,
            )
        except ValueError as exc:
            raise SettingsError(f"POSTBOX_WEBHOOK_MARQETA_*: {exc}") from None
    env = dict(environ)
    for name in settings.generic:
        prefix = f"POSTBOX_WEBHOOK_{name.upper().replace('-', '_')}"
        if name in found or name in ("stripe", "shopify", "marqeta"):
            raise SettingsError(f"POSTBOX_WEBHOOK_GENERIC: {name!r} is already a built-in provider")
        options = {
            key: env[f"{prefix}_{key.upper()}"]
            for key in ("signature_header", "algorithm", "encoding", "id_from", "type_from")
            if f"{prefix}_{key.upper()}" in env
        }
        try:
            found[name] = GenericHmac(name, secret_list(f"{prefix}_SECRETS", env), **options)
        except ValueError as exc:
            raise SettingsError(f"{prefix}_*: {exc}") from None
    return found


def providers_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Provider]:
    """The providers the environment configures (what `postbox inbox serve` builds)."""
    env = os.environ if environ is None else environ
    return providers_from(load(ProviderSettings, None, env).settings, env)
