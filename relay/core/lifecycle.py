"""Process lifecycle shared by every postbox daemon."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType


def stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM (Kubernetes) and SIGINT (Ctrl-C) ask the daemon to finish what it is doing and exit 0."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
