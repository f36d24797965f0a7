"""Waiting for something that happens in another process: wait_until polls a condition until it holds, and
holds_for polls one throughout a period, to show that something does not happen (no duplicate arrives, a
process does not exit)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def holds_for(predicate: Callable[[], bool], seconds: float, interval: float = 0.1, what: str = "") -> None:
    """Assert that `predicate` holds throughout the next `seconds`: polled every `interval` (and once more
    at the end), failing as soon as it does not."""
    started = time.monotonic()
    deadline = started + seconds
    while True:
        if not predicate():
            held = time.monotonic() - started
            raise AssertionError(f"stopped holding after {held:.1f}s of {seconds}s: {what or predicate}")
        if time.monotonic() >= deadline:
            return
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
