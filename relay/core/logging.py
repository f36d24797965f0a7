"""structlog, configured once per process: JSON lines in production, readable console output in a terminal.

Log events are a stable interface: event names are snake_case constants like "relay_batch_published", and
context (topic, shard, counts) is bound as keys. Payloads and secrets are never logged.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import ClassVar, Literal

import structlog

from postbox.relay.core.settings import Settings, setting

LogFormat = Literal["auto", "json", "console"]


def _level(value: str) -> str:
    if logging.getLevelNamesMapping().get(value.upper()) is None:
        raise ValueError("is not a level (debug, info, warning, error)")
    return value


@dataclass(frozen=True, kw_only=True)
class LoggingSettings(Settings):
    """Every command's logging (flags before the command: `postbox --log-format json relay run`)."""

    PREFIX: ClassVar[str] = "POSTBOX_LOG_"

    format: str = setting(
        "auto",
        "log output: auto (console on a terminal), json or console",
        flag="--log-format",
        choices=("auto", "json", "console"),
    )
    level: str = setting("info", "debug, info, warning or error", flag="--log-level", parse=_level)


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"POSTBOX_LOG_LEVEL: unknown level {level!r} (debug, info, warning, error)")
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
