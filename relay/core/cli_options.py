"""Flags that can also be set by environment variables (the flag wins), for every postbox command."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

from relay.core.secrets import secret as read_secret


def env_flag(
    parser: argparse.ArgumentParser, flag: str, env: str, help: str, *, secret: bool = False, **kwargs: Any
) -> None:
    """Add `flag`, defaulting to $env; the help text names the variable so users can find it.

    secret: the value may also come from the file named by ${env}_FILE, and --help never shows it."""
    kind = kwargs.get("type")
    # A switch is False unless given: None would reach SQL as NULL, where it is neither true nor false.
    default = kwargs.pop("default", False if kwargs.get("action") == "store_true" else None)
    if secret:
        try:
            default = read_secret(env) or default
        except ValueError as exc:
            parser.error(str(exc))
        shown = f" (env {env} or {env}_FILE)"
        parser.add_argument(flag, default=default, help=help + shown, **kwargs)
        return
    if env in os.environ:
        raw = os.environ[env]
        if kwargs.get("action") == "store_true":
            default = _parse_bool(env, raw)
        elif kind is not None:
            try:
                default = kind(raw)
            except (TypeError, ValueError) as exc:
                parser.error(f"{env}={raw!r} is not valid: {exc}")
        else:
            default = raw
    shown = f" (env {env}" + (f", default {default!r})" if default not in (None, False) else ")")
    parser.add_argument(flag, default=default, help=help + shown, **kwargs)


def _parse_bool(env: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise SystemExit(f"postbox: {env}={raw!r} is not a boolean (use true or false)")


def add_database_options(parser: argparse.ArgumentParser, schema_default: str | None = "postbox") -> None:
    env_flag(
        parser,
        "--database-url",
        "POSTBOX_DATABASE_URL",
        "PostgreSQL connection URL (libpq syntax, so TLS options such as sslmode go here)",
        secret=True,
    )
    env_flag(
        parser, "--schema", "POSTBOX_SCHEMA", "schema holding the postbox tables", default=schema_default
    )


def duration(text: str) -> timedelta:
    """'90s', '15m', '36h', '7d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return timedelta(seconds=float(text[:-1]) * units[text[-1]])
        return timedelta(seconds=float(text))
    except (ValueError, OverflowError):  # OverflowError: 1e20 or inf (found by the fuzzer)
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m, 36h or 7d") from None


def require(args: argparse.Namespace, parser: argparse.ArgumentParser, *names: str) -> None:
    """Stop with a message naming the setting (flag and variable) when a required one is missing."""
    for name in names:
        if not getattr(args, name, None):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} (or POSTBOX_{name.upper()}) is required")
