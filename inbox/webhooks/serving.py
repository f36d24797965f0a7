"""Running the receiver under uvicorn (httptools and uvloop), safe from slow and idle clients.

uvicorn cuts off an idle keep-alive connection only after a response; a client that connects and sends
its headers a byte at a time is never cut off, and each such client holds a socket and a slot. Here:
- every request's headers must arrive within `read_timeout` of the connection (or of the previous
  response on a kept-alive one), else the connection is answered 408 and closed, and counted;
- the body has the same deadline, enforced by the app (WebhookReceiver, answered 408 and counted);
- at most half the connection cap waiting for headers at once: past that the longest-waiting one is cut
  off, so idle sockets never fill the cap;
- at most `max_connections` connections and requests at once (uvicorn's limit_concurrency: past it, 503),
  kept below the process's file-descriptor limit, which is raised to its hard limit first, so the
  process never runs out of descriptors and `/readyz` and legitimate requests keep working.
"""

from __future__ import annotations

import asyncio
import resource

from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Descriptors kept free beyond the connection cap: the database pool, the metrics port, logs, libraries.
RESERVED_DESCRIPTORS = 64
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: 37\r\n"
    b"connection: close\r\n\r\n"
    b'{"error": "request headers too slow"}'
)


class SlowClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cut_off = Counter(
            "postbox_webhook_slow_clients_total",
            "Connections closed because the request headers did not arrive in time",
            registry=registry,
        )


def protocol_with_header_deadline(
    read_timeout: float, metrics: SlowClientMetrics, max_waiting: int = 512
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline for each request's headers, and at most `max_waiting`
    connections waiting for their headers at once: past that the one that has waited longest is cut off
    to make room. A legitimate client sends its request as soon as it connects, so a pile of idle or
    trickling sockets can neither fill the connection cap nor the file descriptors. (httptools parses in
    C: with uvloop it doubled the requests one process answers, against uvicorn's pure-Python h11.)"""
    waiting: dict[HttpToolsProtocol, None] = {}  # oldest first (dicts keep insertion order)

    class DeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._too_slow)
            waiting[self] = None
            while len(waiting) > max_waiting:
                oldest = next(iter(waiting))
                assert isinstance(oldest, DeadlineProtocol)
                oldest._too_slow()

        def _disarm(self) -> None:
            waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._disarm()  # a request's headers are complete: the app takes it from here

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # a request whose headers came already: it starts now
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._arm()  # a kept-alive connection: the next request's headers have the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _too_slow(self) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            metrics.cut_off.inc()
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    return DeadlineProtocol


def connection_limit(wanted: int) -> int:
    """Raise the soft descriptor limit to the hard one; the connection cap that leaves room for the rest
    (ValueError when even that is too few)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    available = soft - RESERVED_DESCRIPTORS if soft != resource.RLIM_INFINITY else wanted
    if available < 16:
        raise ValueError(f"the process may open only {soft} files; raise its limit (ulimit -n)")
    return min(wanted, available)
