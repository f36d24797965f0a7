"""`postbox config check`: what a daemon would start with, validated, with secrets masked."""

from __future__ import annotations

from collections.abc import Mapping

from relay.core.settings import MissingSetting, Settings, SettingsError, describe, load
from relay.core.tracing import DEFAULT_SERVICE_NAMES, TracingConfigError, plan_tracing


def check_service(
    name: str, cls: type[Settings], environ: Mapping[str, str], *, missing_is_error: bool
) -> tuple[list[str], bool]:
    """Lines describing service `name`'s settings from `environ`, and whether they are valid.

    missing_is_error: when the service was asked for by name, a missing required setting makes it invalid;
    when every service is checked, that service is only "not configured" (a relay's environment need not
    configure the webhook receiver). A value that is given and wrong is invalid either way."""
    try:
        loaded = load(cls, None, environ)
    except MissingSetting as exc:
        if missing_is_error:
            return [f"{name}: INVALID: {exc}"], False
        return [f"{name}: not configured ({exc})"], True
    except SettingsError as exc:
        return [f"{name}: INVALID: {exc}"], False
    lines = [f"{name}: ok", *describe(loaded)]
    lines.extend(f"  warning: {warning}" for warning in loaded.warnings)
    extra = getattr(loaded.settings, "effective_lines", None)
    if callable(extra):
        lines.extend(extra())
    if name in DEFAULT_SERVICE_NAMES:
        try:
            lines.extend(plan_tracing(name, environ).describe())
        except TracingConfigError as exc:
            lines[0] = f"{name}: INVALID: {exc}"
            return lines, False
    return lines, True
