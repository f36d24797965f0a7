"""The webhook receiver: an ASGI app, `POST /webhooks/{provider}`.

In order, and writing nothing until the last step: route; refuse a body over the size limit (413) or of
the wrong content type (415); verify the signature on the raw body (401); parse (400); insert every event
of the request in one statement and answer 200 once it is durable. A duplicate also gets 200. The
database down gets 503 so the provider retries; nothing is half-written because the insert is one
statement. A statement that loses a race (a deadlock with another one storing the same events, a lock
timeout: relay.core.db.transient_database_error) is run again a few times within the request, then
answered 503 too: the provider's data is not at fault, so never 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from postbox.inbox.webhooks.group_insert import EventKey, GroupInsert
from postbox.inbox.webhooks.providers import IncomingEvent, MalformedWebhook, Provider, SignatureError
from postbox.inbox.webhooks.store import INSERT_EVENTS, insert_params
from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.db import database_unavailable, describe_error, transient_database_error
from postbox.relay.core.tracing import current_trace_context

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = structlog.get_logger("postbox.webhooks")
# A statement that met a transient database error is run this many times in all before the request is
# answered 503, with a jittered wait between tries doubling from TRANSIENT_BACKOFF: a deadlock or a short
# lock wait is usually over by then, and a provider's own retry can be hours away.
INSERT_TRIES = 3
TRANSIENT_BACKOFF = 0.05

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def autocommit_in(schema: str) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    """The receiver pool's `configure`: each new connection in autocommit, resolving names in `schema`."""
    search_path = sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema))

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.set_autocommit(True)
        await conn.execute(search_path)

    return configure


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "postbox_webhook_requests_total",
            "Webhook requests by provider and outcome",
            ["provider", "outcome"],
            registry=registry,
        )
        self.events = Counter(
            "postbox_webhook_events_total",
            "Webhook events stored or skipped as duplicates",
            ["provider", "result"],
            registry=registry,
        )
        self.seconds = Histogram(
            "postbox_webhook_request_duration_seconds",
            "Receive to answer",
            ["provider"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.statement_events = Histogram(
            "postbox_webhook_statement_events",
            "Events per insert statement: requests that arrive together share one statement and commit",
            registry=registry,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500),
        )
        # The labelled children, looked up once: prometheus_client's labels() validates and locks on
        # every call, which showed in the receiver's profile.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


@dataclass
class Reply:
    status: int
    body: dict[str, Any]


class WebhookReceiver:
    def __init__(
        self,
        providers: Mapping[str, Provider],
        pool: AsyncConnectionPool[Any],  # configured by autocommit_in(schema)
        metrics: ReceiverMetrics,
        max_body_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.time,
        read_timeout: float = 10.0,
        max_statements: int = 2,
        tracer: Tracer | None = None,
    ) -> None:
        self.providers = dict(providers)
        self._tracer = tracer
        self.pool = pool
        self._writes = GroupInsert(self._insert, max_in_flight=max_statements)
        self._loop: asyncio.AbstractEventLoop | None = None  # uvicorn's, set at startup
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout  # for the whole body, from the end of the headers
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        try:
            provider_name, reply = await self._answer(scope, receive)
        except Exception as exc:  # noqa: BLE001  (a bug: answered and counted, never a dropped connection)
            provider_name, reply = self._provider_of(scope), Reply(500, {"error": "internal error"})
            # No traceback: its last line is str(exc), which can quote the body. Where it failed is enough.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            log.error(
                "webhook_internal_error",
                provider=provider_name,
                error=f"{type(exc).__name__}: {describe_error(exc)}",
                at=f"{frame.filename}:{frame.lineno}",
            )
        if provider_name is not None:
            outcome = "accepted" if reply.status == 200 else str(reply.status)
            self.metrics.child(self.metrics.requests, provider_name, outcome).inc()
            self.metrics.child(self.metrics.seconds, provider_name).observe(time.perf_counter() - started)
        body = json.dumps(reply.body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _provider_of(self, scope: Scope) -> str | None:
        prefix, _, name = str(scope.get("path", "")).rpartition("/")
        return name if prefix == "/webhooks" and name in self.providers else None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                await self.pool.open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _answer(self, scope: Scope, receive: Receive) -> tuple[str | None, Reply]:
        """_handle, inside a receive span when tracing is on and the path is a provider's."""
        name = self._provider_of(scope) if self._tracer is not None else None
        if name is None or self._tracer is None:
            return await self._handle(scope, receive)
        from postbox.inbox.tracing import receiving, replied  # noqa: PLC0415  (OpenTelemetry is optional)

        with receiving(
            self._tracer, name, {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        ) as span:
            found, reply = await self._handle(scope, receive)
            replied(span, reply.status, reply.body)
        return found, reply

    async def _handle(self, scope: Scope, receive: Receive) -> tuple[str | None, Reply]:  # noqa: PLR0911  (one exit per gate, in order)
        path: str = scope["path"]
        if path == "/healthz":
            return None, Reply(200, {"status": "ok"})
        if path == "/readyz":
            return None, await self._ready()
        name = self._provider_of(scope)
        if name is None:
            return None, Reply(404, {"error": "no such webhook endpoint"})
        provider = self.providers[name]
        if scope["method"] != "POST":
            return name, Reply(405, {"error": "use POST"})
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return name, Reply(413, {"error": f"body over {self.max_body_bytes} bytes"})
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return name, Reply(415, {"error": f"content type must be application/json, got {content_type!r}"})
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.read_timeout)
        except TimeoutError:
            log.warning("webhook_body_too_slow", provider=name, seconds=self.read_timeout)
            return name, Reply(408, {"error": f"body not received within {self.read_timeout:.0f}s"})
        if body is None:
            return name, Reply(413, {"error": f"body over {self.max_body_bytes} bytes"})
        try:
            provider.verify(headers, body, self.clock())
        except SignatureError as exc:
            log.warning("webhook_signature_rejected", provider=name, reason=str(exc))
            return name, Reply(401, {"error": "signature verification failed"})
        try:
            events = provider.events(headers, body)
        except MalformedWebhook as exc:
            return name, Reply(400, {"error": str(exc)})
        if not events:
            return name, Reply(200, {"accepted": 0, "duplicates": 0})
        return name, await self._stored(name, events)

    async def _stored(self, name: str, events: list[IncomingEvent]) -> Reply:
        """Store the request's events in one statement; the answer for it."""
        if self._tracer is not None:
            # The receive span's context, kept with each event: the worker's process span links to it.
            context = current_trace_context()
            for event in events:
                event.headers.update(context)
        try:
            stored = await self._writes.store(events)
        except psycopg.Error as exc:  # PoolTimeout included: it is an OperationalError with no SQLSTATE
            if database_unavailable(exc):
                log.error("webhook_database_unavailable", provider=name, error=describe_error(exc))
                return Reply(503, {"error": "temporarily unavailable, retry later"})
            if transient_database_error(exc):
                # Retried already (_insert) and still losing the race, say to a lock a long transaction holds.
                log.error("webhook_database_busy", provider=name, error=describe_error(exc))
                return Reply(503, {"error": "temporarily unavailable, retry later"})
            # The database refused this request's data (a value jsonb or the key cannot hold): retrying
            # would fail the same way forever, so it is a 4xx, and nothing was stored (one statement).
            log.warning("webhook_event_unstorable", provider=name, error=describe_error(exc))
            return Reply(400, {"error": f"event cannot be stored ({exc.sqlstate})"})
        duplicates = len(events) - stored
        self.metrics.child(self.metrics.events, name, "stored").inc(stored)
        self.metrics.child(self.metrics.events, name, "duplicate").inc(duplicates)
        # debug: one line per accepted request is an access log (the counters above carry the same); every
        # refusal is logged at warning or error.
        log.debug("webhook_received", provider=name, events=len(events), stored=stored, duplicates=duplicates)
        return Reply(200, {"accepted": stored, "duplicates": duplicates})

    def ready(self) -> tuple[bool, str]:
        """The same readiness as GET /readyz, for the metrics port (whose server runs on its own thread):
        the check runs on the receiver's event loop, bounded by a short timeout."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False, "not started"
        try:
            reply = asyncio.run_coroutine_threadsafe(self._ready(), loop).result(timeout=3.0)
        except (TimeoutError, RuntimeError) as exc:
            return False, f"readiness check did not finish: {type(exc).__name__}"
        return reply.status == 200, str(reply.body.get("status", ""))

    async def _ready(self) -> Reply:
        """Ready only while the database answers: a receiver that cannot store must not take traffic."""
        try:
            async with self.pool.connection(timeout=2.0) as conn:
                await conn.execute("SELECT 1")
        except psycopg.Error as exc:  # PoolTimeout included
            return Reply(503, {"status": "database unavailable", "error": describe_error(exc)[:200]})
        return Reply(200, {"status": "ok"})

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None  # stop reading: a chunked body over the limit is refused as early as possible
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _insert(self, events: Sequence[IncomingEvent]) -> set[EventKey]:
        """_insert_once, run again after a transient database error (a lost race, not bad data), up to
        INSERT_TRIES in all. A lost database is not retried here: the answer is 503 at once."""
        for tries in range(1, INSERT_TRIES + 1):
            try:
                return await self._insert_once(events)
            except psycopg.Error as exc:
                if tries == INSERT_TRIES or database_unavailable(exc) or not transient_database_error(exc):
                    raise
                delay = backoff_delay(tries, base=TRANSIENT_BACKOFF, cap=1.0)
                log.warning(
                    "webhook_insert_retry", attempt=tries, error=describe_error(exc), retry_in=round(delay, 3)
                )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last try returns or raises")

    async def _insert_once(self, events: Sequence[IncomingEvent]) -> set[EventKey]:
        # One statement in autocommit: atomic and durable when it returns, in one round trip (an explicit
        # transaction would add BEGIN and COMMIT). The pool's connections come in autocommit with the
        # schema on their search_path (autocommit_in).
        self.metrics.statement_events.observe(len(events))
        async with self.pool.connection() as conn:
            cursor = await conn.execute(INSERT_EVENTS, insert_params(events))
            return {(provider, event_id) for provider, event_id in await cursor.fetchall()}
