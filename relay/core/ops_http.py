"""/metrics, /healthz and /readyz on their own port, for Prometheus and Kubernetes probes.

/healthz answers 200 while the main loop has turned recently (a liveness probe restarts a stuck process);
/readyz answers 200 only while the process is connected and doing its work, else 503 with the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Check = Callable[[], tuple[bool, str]]


class OpsServer:
    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, healthy: Check, ready: Check
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path in ("/healthz", "/readyz"):
                    ok, reason = (healthy if self.path == "/healthz" else ready)()
                    self._send(200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds would drown the structured logs

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="ops-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> OpsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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
        server = OpsServer(host or "0.0.0.0", int(port), registry, healthy, ready).start()  # noqa: S104
    except OSError as exc:
        raise SystemExit(
            f"postbox: --metrics-address {address} (POSTBOX_METRICS_ADDRESS) cannot be served: "
            f"{exc.strerror or exc} (choose a free port)"
        ) from None
    try:
        yield
    finally:
        server.stop()
