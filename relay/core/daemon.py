"""The skeleton every postbox daemon runs on: the relay, the inbox consumer, the webhook worker and the
reconciler. One place decides how a daemon stops (SIGTERM, SIGINT), how it proves it is alive (a main-loop
heartbeat behind /healthz), what "the database is gone" means (relay.core.db.database_unavailable), and
how it comes back (reconnect after a capped, jittered wait that a stop interrupts). Each daemon supplies
only its turn, its connections and its readiness.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import structlog
import tenacity

from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.db import describe_error
from postbox.relay.core.lifecycle import stop_on_signals


class Daemon:
    def __init__(
        self,
        name: str,
        *,
        stall_limit: float = 120.0,
        backoff: Callable[[int], float] = backoff_delay,
    ) -> None:
        """name: the daemon's log prefix (relay, inbox, webhook_worker, reconciler).
        stall_limit: seconds without a heartbeat after which /healthz fails (the process is wedged).
        backoff: seconds to wait after n losses in a row (default: full jitter, doubling, 30 s cap)."""
        self.name = name
        self.stall_limit = stall_limit
        self.last_beat = time.monotonic()
        self.losses = 0  # database losses since the last turn that went through
        self._stop = threading.Event()
        self._backoff = backoff
        self._log = structlog.get_logger(f"postbox.{name}")

    # -- stopping ----------------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._log.info(f"{self.name}_stopping")
        self._stop.set()

    def install_signal_handlers(self) -> None:
        stop_on_signals(self.stop)

    def sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less when asked to stop (a signal handler sets the event mid-wait)."""
        if seconds > 0:
            self._stop.wait(seconds)

    # -- liveness ----------------------------------------------------------------------------------------

    def beat(self) -> None:
        """The main loop is turning: call at least once per turn (and during long turns)."""
        self.last_beat = time.monotonic()

    def healthy(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self.last_beat
        return (
            stalled < self.stall_limit,
            f"main loop last turned {stalled:.1f}s ago (limit {self.stall_limit:.0f}s)",
        )

    # -- the loop ----------------------------------------------------------------------------------------

    def run(
        self,
        turn: Callable[[], None],
        *,
        lost: Callable[[BaseException], bool],
        on_lost: Callable[[BaseException], None],
    ) -> int:
        """Call `turn` until stopped; 0 after a clean stop.

        lost(exc): the daemon's one decision whether `exc` means its connection is gone (for the database:
        relay.core.db.database_unavailable with its connections). Then on_lost(exc) drops the connections,
        the wait grows with each loss in a row (jittered, capped), and the turns go on, reconnecting.
        Anything else propagates: a bug or a schema problem must fail loudly rather than loop."""

        def turns() -> None:
            while not self.stopping:
                self.beat()
                turn()
                self.losses = 0

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lost),
            wait=self._wait,
            before_sleep=self._before_sleep(on_lost),
            sleep=self.sleep,  # a stop ends the wait; `turns` then returns at once
            reraise=True,
        )
        retrying(turns)
        return 0

    def _wait(self, retry_state: tenacity.RetryCallState) -> float:
        # tenacity counts every loss since the start; the wait grows only over the losses in a row (`turns`
        # resets the count after a turn that went through).
        self.losses += 1
        return self._backoff(self.losses)

    def _before_sleep(
        self, on_lost: Callable[[BaseException], None]
    ) -> Callable[[tenacity.RetryCallState], None]:
        def before_sleep(retry_state: tenacity.RetryCallState) -> None:
            outcome = retry_state.outcome
            exc = outcome.exception() if outcome is not None else None
            assert exc is not None  # only a raised turn is retried
            if isinstance(exc, psycopg.Error):  # other losses (the relay's id in use) are logged by on_lost
                self._log.warning(
                    f"{self.name}_database_unavailable",
                    error=describe_error(exc),
                    retry_in=round(retry_state.upcoming_sleep, 2),
                )
            on_lost(exc)

        return before_sleep
