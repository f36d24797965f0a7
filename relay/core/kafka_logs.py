"""librdkafka's own log lines, through structlog and rate-limited.

Left alone, librdkafka prints its lines raw on stderr, outside the JSON log stream: with every broker down
a producer prints one per reconnect attempt, about 20 a second. Given a `logger` in its configuration,
confluent_kafka hands each line to logger.log(level, "%s [%s] %s", facility, client name, text) from the
client's poll() instead; KafkaLogAdapter turns it into the event `kafka_client_log` (keys: facility,
client, message, and suppressed when earlier lines of the same shape were held back).

LogLimiter is the pure part: at most `burst` lines per `interval` seconds of each distinct message,
numbers that only count time or repeats ignored, with a count of the rest.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

# Parts of a librdkafka line that change between repeats of the same trouble: "(after 12ms in state
# CONNECT)", "5 identical error(s) suppressed".
_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|s)\b")
_REPEATS = re.compile(r",?\s*\b\d+ identical error\(s\) suppressed")
Shape = tuple[str, str]  # (facility, text with the varying numbers blanked)
MAX_KEYS = 1000  # distinct messages remembered; past it the oldest is forgotten (bounded memory)


def message_shape(facility: str, text: str) -> Shape:
    """What makes two librdkafka lines "the same message" for the limit."""
    return facility, _REPEATS.sub("", _DURATION.sub("#", text))


class LogLimiter:
    """At most `burst` lines per `interval` seconds for each key; the rest are counted. Pure (the clock is
    given) apart from a lock: confluent_kafka may call from several threads' polls."""

    def __init__(
        self, burst: int = 3, interval: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        # key -> [window start, lines let through in the window, lines held back since the last let through]
        self._windows: dict[Shape, list[float]] = {}

    def admit(self, key: Shape) -> int | None:
        """None: hold this line back. Else let it through, with how many lines of `key` were held back
        since the last one let through (0 if none)."""
        with self._lock:
            now = self._clock()
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= MAX_KEYS:
                    del self._windows[next(iter(self._windows))]
                window = self._windows[key] = [now, 0, 0]
            elif now - window[0] >= self.interval:
                window[0], window[1] = now, 0
            if window[1] < self.burst:
                window[1] += 1
                held, window[2] = int(window[2]), 0
                return held
            window[2] += 1
            return None

    def overdue(self) -> list[tuple[Shape, int]]:
        """Keys whose window has ended with lines held back, and how many (then forgotten): reported even
        when that message never comes again, so no count is lost with it."""
        with self._lock:
            now = self._clock()
            found = []
            for key, window in self._windows.items():
                if window[2] and now - window[0] >= self.interval:
                    found.append((key, int(window[2])))
                    window[2] = 0
            return found


class KafkaLogAdapter(logging.Logger):
    """The `logger` confluent_kafka calls with librdkafka's lines (a logging.Logger, as it expects)."""

    def __init__(self, limiter: LogLimiter | None = None) -> None:
        super().__init__("postbox.kafka")
        self.limiter = limiter or LogLimiter()
        self._events = structlog.get_logger("postbox.kafka")

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        facility, client, text = (str(a) for a in args) if len(args) == 3 else ("", "", str(msg) % args)
        for (old_facility, old_text), held in self.limiter.overdue():
            self._events.warning(
                "kafka_client_log_suppressed", facility=old_facility, message=old_text, suppressed=held
            )
        held_back = self.limiter.admit(message_shape(facility, text))
        if held_back is None:
            return
        extra = {"suppressed": held_back} if held_back else {}
        self._events.log(level, "kafka_client_log", facility=facility, client=client, message=text, **extra)
