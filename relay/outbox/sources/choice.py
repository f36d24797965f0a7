"""Which source a relay reads from: its --mode, checked against the outbox's (or, with --mode auto, the
outbox's own). Asked at every connect and lease tick, with no batch open, so a relay follows a switch of
modes (`postbox relay switch-mode`) without a restart, and an idle relay finds it too."""

from __future__ import annotations

import threading
from collections.abc import Callable

from postbox.relay.outbox import admin
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.settings import RelaySettings, mode_to_follow
from postbox.relay.outbox.sources.base import BatchSource, Connection, RelayConfigurationError
from postbox.relay.outbox.sources.log import LogSource
from postbox.relay.outbox.sources.log_reader import log_started, outbox_in_log_mode, shards_behind_switch
from postbox.relay.outbox.sources.queue import Claimer, QueueSource


def mode_to_read(conn: Connection, requested: str, reading: str | None) -> tuple[str, str]:
    """(the mode to read in, and why), for a relay run with --mode `requested` that reads in `reading`
    now (None before its first batch). --mode auto follows the outbox's mode, which after a switch back to
    queue mode is log mode until every shard's log is read to the switch. A pinned mode that would leave
    rows unread raises RelayConfigurationError: a queue relay on a log-mode outbox never reads the log; a
    log relay on an outbox never switched has no cursors."""
    foreign = admin.foreign_log(conn)
    if foreign is not None:
        raise RelayConfigurationError(foreign)
    in_log_mode = outbox_in_log_mode(conn)
    started = log_started(conn)
    behind = shards_behind_switch(conn) if started else 0
    if requested == "auto":
        mode = mode_to_follow(in_log_mode, behind)
        read_to_switch = started and not in_log_mode and reading == "log"
        return mode, "the log is read to the switch back" if read_to_switch else "the outbox's mode"
    if in_log_mode and requested == "queue":
        raise RelayConfigurationError(
            "the outbox is in log mode: run the relay with --mode log or auto (POSTBOX_RELAY_MODE), or "
            "switch the outbox back first (postbox relay switch-mode queue)"
        )
    if requested == "log" and not in_log_mode and not started:
        raise RelayConfigurationError(
            "--mode log: the outbox is in queue mode; switch it first (postbox relay switch-mode log)"
        )
    if requested == "queue" and behind:
        raise RelayConfigurationError(
            f"the outbox was switched back to queue mode, but the log of {behind} shards is not read "
            "to the switch yet: run the relays with --mode log or auto until `postbox relay status` "
            "shows it read"
        )
    return requested, "--mode"


def make_source(
    mode: str,
    settings: RelaySettings,
    claimer: Claimer,
    *,
    tick_conn: Callable[[], Connection],
    tick_lock: threading.Lock,
    metrics: RelayMetrics,
) -> BatchSource:
    """The source that reads an outbox in `mode` (`queue` or `log`, as mode_to_read says)."""
    if mode == "queue":
        return QueueSource(claimer, settings.batch_size)
    if mode == "log":
        return LogSource(
            claimer,
            settings.batch_size,
            schema=settings.schema,
            tick_interval=settings.tick_interval,
            tick_conn=tick_conn,
            tick_lock=tick_lock,
            metrics=metrics,
        )
    raise ValueError(f"no source reads an outbox in mode {mode!r}")
