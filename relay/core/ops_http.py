"""/metrics, /healthz and /readyz on their own port, for Prometheus and Kubernetes probes.

/healthz answers 200 while the main loop has turned recently (a liveness probe restarts a stuck process);
/readyz answers 200 only while the process is connected and doing its work, else 503 with the reason.

One thread runs an asyncio server for every connection: an idle or slow client costs a socket, not a
thread, and is cut off after READ_TIMEOUT. Past MAX_CONNECTIONS waiting for their request at once, the
one that has waited longest is closed to make room: a probe or a scrape sends its request as soon as it
connects, so a pile of idle sockets delays it by nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Check = Callable[[], tuple[bool, str]]

READ_TIMEOUT = 5.0  # seconds for the request line and headers
MAX_CONNECTIONS = 256
MAX_REQUEST_BYTES = 8192


def _response(status: int, body: bytes, content_type: str) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(
        status, "Service Unavailable"
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def route(request_line: bytes, registry: CollectorRegistry, healthy: Check, ready: Check) -> bytes:
    """The whole response to one request line (`GET /path HTTP/1.1`). Pure apart from the checks."""
    text = "text/plain; charset=utf-8"
    parts = request_line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response(400, b"bad request\n", text)
    method, path = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response(405, b"use GET\n", text)
    if path == "/metrics":
        return _response(200, generate_latest(registry), CONTENT_TYPE_LATEST)
    if path in ("/healthz", "/readyz"):
        ok, reason = (healthy if path == "/healthz" else ready)()
        return _response(200 if ok else 503, (reason + "\n").encode(), text)
    return _response(404, b"not found\n", text)


class OpsServer:
    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, healthy: Check, ready: Check
    ) -> None:
        self._registry, self._healthy, self._ready = registry, healthy, ready
        self._loop = asyncio.new_event_loop()
        # Connections still waiting for their request, oldest first (dicts keep insertion order).
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        try:
            # Bound here, in the caller's thread, so a port already taken fails the start at once.
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES, backlog=128)
            )
        except BaseException:
            self._loop.close()
            raise
        self._thread = threading.Thread(target=self._loop.run_forever, name="ops-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1])

    def start(self) -> OpsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) >= MAX_CONNECTIONS:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.close()  # its read fails at once and that handler ends
        self._waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return  # too slow, too long, evicted or gone: nothing worth answering
            finally:
                self._waiting.pop(writer, None)
            request_line = head.split(b"\r\n", 1)[0]
            response = route(request_line, self._registry, self._healthy, self._ready)
            if request_line.startswith(b"HEAD "):
                response = response.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
            writer.write(response)
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
        finally:
            writer.close()


@contextmanager
def serving(address: str | None, registry: CollectorRegistry, healthy: Check, ready: Check) -> Iterator[None]:
    """/metrics, /healthz and /readyz on `address` (host:port) for the life of the block; nothing if None."""
    if not address:
        yield
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise SystemExit(f"postbox: --metrics-address {address!r} is not host:port")
    try:
        server = OpsServer(host.strip("[]") or "0.0.0.0", int(port), registry, healthy, ready).start()  # noqa: S104
    except OSError as exc:
        raise SystemExit(
            f"postbox: --metrics-address {address} (POSTBOX_METRICS_ADDRESS) cannot be served: "
            f"{exc.strerror or exc} (choose a free port)"
        ) from None
    try:
        yield
    finally:
        server.stop()
