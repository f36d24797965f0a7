"""The daemon skeleton's contract, without servers: what is retried, how the wait grows and resets, and
that a stop ends a wait at once. (Each daemon's reconnects against real servers are integration tests.)"""

import threading
import time
from functools import partial

import pytest

from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.daemon import Daemon
from tests.support.waiting import wait_until


class Lost(Exception):
    pass


def test_a_lost_connection_is_survived_and_anything_else_propagates() -> None:
    daemon = Daemon("test", backoff=lambda _losses: 0.01)
    calls: list[str] = []
    script = iter(["lost", "ok", "lost", "bug"])

    def turn() -> None:
        step = next(script)
        calls.append(step)
        if step == "lost":
            raise Lost
        if step == "bug":
            raise ValueError("a bug must not loop")

    dropped: list[BaseException] = []
    with pytest.raises(ValueError, match="a bug"):
        daemon.run(turn, lost=lambda exc: isinstance(exc, Lost), on_lost=dropped.append)
    assert calls == ["lost", "ok", "lost", "bug"]
    assert len(dropped) == 2


def test_the_wait_grows_over_losses_in_a_row_and_starts_again_after_a_turn_that_went_through() -> None:
    daemon = Daemon("test", backoff=partial(backoff_delay, cap=1000.0))
    seen: list[int] = []
    script = iter(["lost"] * 4 + ["ok"] + ["lost"] + ["stop"])

    def turn() -> None:
        step = next(script)
        if step == "lost":
            raise Lost
        if step == "stop":
            daemon.stop()

    waits: list[float] = []
    daemon.sleep = waits.append  # type: ignore[method-assign]
    daemon.run(turn, lost=lambda exc: isinstance(exc, Lost), on_lost=lambda _exc: seen.append(daemon.losses))
    assert seen == [1, 2, 3, 4, 1], "the count restarts after the turn that went through"
    # Full jitter: each wait is uniform in [0, 0.5 * 2^n], so only the bounds can be asserted.
    for losses, wait in zip(seen, waits, strict=True):
        assert 0 <= wait <= 0.5 * 2**losses


def test_a_stop_ends_a_wait_at_once_and_the_run_returns_zero() -> None:
    daemon = Daemon("test", backoff=lambda _losses: 600.0)  # every wait the full 600 s

    def turn() -> None:
        raise Lost

    threading.Timer(0.3, daemon.stop).start()
    started = time.monotonic()
    assert daemon.run(turn, lost=lambda exc: isinstance(exc, Lost), on_lost=lambda _exc: None) == 0
    assert time.monotonic() - started < 5


def test_healthy_until_the_loop_stalls() -> None:
    daemon = Daemon("test", stall_limit=0.2)
    started = time.monotonic()
    assert daemon.healthy()[0]
    wait_until(lambda: not daemon.healthy()[0], 5, interval=0.01, what="the stall noticed")
    assert time.monotonic() - started >= 0.2, "not before the stall limit"
    ok, reason = daemon.healthy()
    assert not ok
    assert reason.startswith("main loop last turned")
    daemon.beat()
    assert daemon.healthy()[0]
