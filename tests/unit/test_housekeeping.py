"""The relay's housekeeping thread, without servers: what it raises reaches the relay's main loop (check),
a round that never finishes shows as stalled (for /healthz), and a stop ends the thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from postbox.relay.outbox.housekeeping import Housekeeping
from postbox.relay.outbox.metrics import RelayMetrics
from tests.support.waiting import wait_until


def housekeeping(connect: Any, interval: float = 0.01) -> Housekeeping:
    return Housekeeping(
        connect,
        RelayMetrics(CollectorRegistry()),
        interval=interval,
        partition_xids=1_000_000,
        prune_retention=None,
        prune_interval=60.0,
        source_upkeep=lambda _conn: None,
    )


def test_an_error_in_the_thread_is_raised_by_check_in_the_main_loops_thread() -> None:
    def connect(_autocommit: bool) -> Any:
        raise RuntimeError("no database here")

    keeper = housekeeping(connect)
    keeper.check()  # nothing yet: not started
    keeper.start()
    wait_until(lambda: not keeper._thread.is_alive(), 5, what="the thread ends on its error")
    with pytest.raises(RuntimeError, match="no database here"):
        keeper.check()
    assert keeper.stalled_for() == 0.0, "a failed thread is reported by check, not as stalled"


def test_a_round_that_does_not_finish_shows_as_stalled_and_stop_leaves_it_to_end() -> None:
    entered, release = threading.Event(), threading.Event()

    def connect(_autocommit: bool) -> Any:
        entered.set()
        release.wait(10)
        raise RuntimeError("released")

    keeper = housekeeping(connect, interval=0.01)
    keeper.start()
    assert entered.wait(5)
    # The interval is 0.01 s: a round stuck in its first statement is late at once, and more so over time.
    wait_until(lambda: keeper.stalled_for() > 0.05, 5, what="the stuck round shows as stalled")
    keeper.stop(timeout=0.05)  # the thread is stuck (no connection yet to cancel): stop returns anyway
    assert keeper._thread.is_alive()
    release.set()
    wait_until(lambda: not keeper._thread.is_alive(), 5, what="the thread ends once released")
