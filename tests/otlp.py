"""An OTLP/HTTP trace receiver for tests and benchmarks: `POST /v1/traces`, the real protocol (protobuf,
gzip or not), decoded with opentelemetry-proto, as a collector would."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

# opentelemetry.proto's Span.SpanKind numbers
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int

    def event(self, name: str) -> dict[str, Any] | None:
        return next((attrs for found, attrs in self.events if found == name), None)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


@dataclass
class OtlpReceiver:
    """Started on a free port; `decode=False` only counts requests, bytes and spans (for benchmarks)."""

    decode: bool = True
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    bytes: int = 0
    span_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._receive(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        found = list(self._decoded(request)) if self.decode else []
        with self._lock:
            self.requests += 1
            self.bytes += len(body)
            self.span_count += count
            self.spans.extend(found)

    @staticmethod
    def _decoded(request: ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield ReceivedSpan(
                        service=service,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=KINDS.get(span.kind, str(span.kind)),
                        attributes=_attributes(span.attributes),
                        events=[(e.name, _attributes(e.attributes)) for e in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        status=span.status.code,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(
        self, what: str, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout}s; received: {[s.name for s in self.spans]}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
