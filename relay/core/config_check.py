"""`postbox config check`: what the daemons would start with, validated, with secrets masked."""

from __future__ import annotations

import os
from collections.abc import Callable

from relay.core.redact import redact


def environment_lines(environ: dict[str, str] | None = None) -> list[str]:
    environ = dict(os.environ) if environ is None else environ
    return [
        f"  {name} = {redact(name, value)}"
        for name, value in sorted(environ.items())
        if name.startswith("POSTBOX_")
    ]


def run_checks(checks: dict[str, Callable[[], dict[str, object] | None]]) -> tuple[list[str], bool]:
    """Run each component's check; a check returns its effective settings, None when not configured, or
    raises ValueError naming the bad setting."""
    lines: list[str] = []
    ok = True
    for component, check in checks.items():
        try:
            settings = check()
        except (ValueError, SystemExit) as exc:
            lines.append(f"{component}: INVALID: {exc}")
            ok = False
            continue
        if settings is None:
            lines.append(f"{component}: not configured")
            continue
        lines.append(f"{component}: ok")
        lines.extend(f"  {key} = {redact(key, str(value))}" for key, value in sorted(settings.items()))
    return lines, ok
