"""The webhook receiver put together from its settings: the connection pool, the ASGI app, the uvicorn
server, the start-up refusal of a database that will never work, and the readiness check of the metrics
port; then run as one process (serve_one) or as `--workers` processes on one port (serve_processes, with
inbox.webhooks.processes). `postbox inbox serve` (inbox.cli) only parses and calls these.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from postbox.relay.core.tracing import Tracing, start_tracing_for


def stop_if_refused(settings: Any) -> None:
    """The receiver answers 503 while its database is down and its pool reconnects by itself, which is
    right for an outage. A database that refuses it for good (no such database or role, a wrong password)
    or a schema that is not migrated would make that forever: those stop the start, with the reason (the
    CLI's dispatch prints it). A database that is merely down lets the receiver start, as before."""
    import psycopg  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.migrate import applied_version, load_migrations  # noqa: PLC0415
    from postbox.relay.core.operator_errors import (  # noqa: PLC0415
        OperatorMistake,
        SchemaState,
        permanent_connect_failure,
        schema_verdict,
    )

    try:
        with connect(
            settings.database_url, settings.schema, autocommit=True, application_name="postbox-webhooks"
        ) as conn:
            applied = applied_version(conn, settings.schema)
    except psycopg.Error as exc:
        if permanent_connect_failure(exc):
            raise
        return
    verdict = schema_verdict(SchemaState(settings.schema, applied, load_migrations()[-1].version))
    if verdict is not None:
        raise OperatorMistake(verdict)


def database_answers(settings: Any) -> tuple[bool, str]:
    import psycopg  # noqa: PLC0415
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415

    from postbox.relay.core.db import describe_error, liveness_options  # noqa: PLC0415

    conninfo = make_conninfo(settings.database_url, **liveness_options(settings.database_url))
    try:
        with psycopg.connect(conninfo, connect_timeout=2, application_name="postbox-webhooks") as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return False, f"database unavailable: {describe_error(exc)[:200]}"
    return True, "ok"


def build_receiver(settings: Any, max_connections: int, registry: Any, tracer: Any) -> tuple[Any, Any]:
    """The receiver app and the uvicorn server that runs it, its metrics in `registry`."""
    import uvicorn  # noqa: PLC0415
    from psycopg_pool import AsyncConnectionPool  # noqa: PLC0415

    from postbox.inbox.webhooks.config import providers_from  # noqa: PLC0415
    from postbox.inbox.webhooks.receiver import ReceiverMetrics, WebhookReceiver, autocommit_in  # noqa: PLC0415
    from postbox.inbox.webhooks.serving import SlowClientMetrics, protocol_with_header_deadline  # noqa: PLC0415
    from postbox.relay.core.db import liveness_options  # noqa: PLC0415

    # open=False: the pool opens in the app's lifespan, inside uvicorn's event loop. A database that is
    # down at start is not fatal: requests answer 503 until it is back.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        settings.database_url,
        min_size=1,
        max_size=settings.pool_size,
        open=False,
        timeout=5.0,
        kwargs={"application_name": "postbox-webhooks", **liveness_options(settings.database_url)},
        configure=autocommit_in(settings.schema),
    )
    app = WebhookReceiver(
        providers_from(settings, os.environ),
        pool,
        ReceiverMetrics(registry),
        settings.max_body_bytes,
        read_timeout=settings.read_timeout,
        tracer=tracer,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        loop="uvloop",
        http=protocol_with_header_deadline(
            settings.read_timeout, SlowClientMetrics(registry), max_waiting=max(8, max_connections // 2)
        ),
        limit_concurrency=max_connections,
    )
    return app, graceful_server_class()(config)


def graceful_server_class() -> Any:
    import uvicorn  # noqa: PLC0415

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die by the signal;
        postbox daemons exit 0 after a clean stop. (It clears uvicorn's private list of captured signals,
        so a test checks the exit code.)"""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return GracefulServer


def serve_on(settings: Any, max_connections: int, log_format: str, log_level: str, sock: Any) -> None:
    """One of `--workers` receiver processes, on the socket its parent bound (inbox.webhooks.processes)."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from postbox.relay.core.logging import configure_logging  # noqa: PLC0415

    configure_logging(log_format, log_level)  # type: ignore[arg-type]
    with start_tracing_for("receiver", os.environ) as tracing:  # the parent checked the OTEL_* variables
        # Its metrics are counted in the parent's files (shared_metrics), not in this registry.
        _, server = build_receiver(settings, max_connections, CollectorRegistry(), tracing.tracer)
        server.run(sockets=[sock])


def serve_one(settings: Any, max_connections: int, tracing: Tracing) -> int:
    """The receiver in this process, its metrics port beside it, until SIGTERM; `tracing` ends with it."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from postbox.relay.core.ops_http import serving  # noqa: PLC0415

    registry = CollectorRegistry()
    app, server = build_receiver(settings, max_connections, registry, tracing.tracer)
    # The receiver answers /healthz and /readyz on the webhook port itself; the metrics port gives the
    # same readiness (database reachable within a short timeout). Liveness there is the process answering.
    with tracing, serving(settings.metrics_address, registry, lambda: (True, "ok"), app.ready):
        server.run()
    return 0


def serve_processes(settings: Any, max_connections: int, log_format: str, log_level: str) -> int:
    """`settings.workers` receiver processes on one port this process binds, each logging as given, and
    the metrics port adding up their metrics, until SIGTERM; the exit code (inbox.webhooks.processes)."""
    from postbox.inbox.webhooks.processes import ReceiverProcesses, listening_socket, shared_metrics  # noqa: PLC0415
    from postbox.relay.core.ops_http import serving  # noqa: PLC0415

    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as exc:
        # A port in use stops the start here, before any process starts: the reason on stderr, exit 1.
        raise SystemExit(
            f"postbox: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
        ) from None
    target = functools.partial(serve_on, settings, max_connections, log_format, log_level)
    with shared_metrics() as registry:
        processes = ReceiverProcesses(target, sock, settings.workers, lambda: database_answers(settings))
        processes.install_signal_handlers()
        with serving(settings.metrics_address, registry, processes.healthy, processes.ready):
            return processes.run()
