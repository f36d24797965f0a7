"""`postbox inbox ...`: run a service's inbox consumer, and keep the inbox table trimmed."""

from __future__ import annotations

import argparse
import importlib
from typing import Any, TypeVar

from relay.core.cli_options import add_database_options, duration, env_flag, require

T = TypeVar("T")


def add_inbox_commands(commands: Any) -> None:
    inbox = commands.add_parser("inbox", help="consume Kafka topics idempotently into PostgreSQL")
    sub = inbox.add_subparsers(dest="inbox_command", metavar="INBOX_COMMAND", required=True)

    consume = sub.add_parser("consume", help="run an inbox consumer (until SIGTERM)")
    add_database_options(consume, schema_default=None)  # unset: the schema the app's Inbox names
    env_flag(consume, "--app", "POSTBOX_INBOX_APP", "your handlers: module:attribute naming an inbox.Inbox")
    env_flag(consume, "--kafka-bootstrap", "POSTBOX_KAFKA_BOOTSTRAP", "Kafka bootstrap servers")
    env_flag(consume, "--topics", "POSTBOX_INBOX_TOPICS", "comma-separated topics to consume")
    env_flag(
        consume, "--group-id", "POSTBOX_INBOX_GROUP_ID", "Kafka consumer group (default: the inbox's name)"
    )
    env_flag(
        consume,
        "--batch-size",
        "POSTBOX_BATCH_SIZE",
        "messages per poll and transaction",
        type=int,
        default=500,
    )
    env_flag(
        consume,
        "--max-batch-bytes",
        "POSTBOX_INBOX_MAX_BATCH_BYTES",
        "bytes of messages fetched ahead and held at once (librdkafka's fetch and local queue sizes)",
        type=int,
        default=16 << 20,
    )
    consume.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="librdkafka property, repeatable; also POSTBOX_RDKAFKA_<NAME>",
    )
    env_flag(
        consume,
        "--metrics-address",
        "POSTBOX_METRICS_ADDRESS",
        "host:port for /metrics, /healthz, /readyz (off when unset)",
    )
    consume.set_defaults(handler=_cmd_consume)

    serve = sub.add_parser("serve", help="the webhook receiver: POST /webhooks/{provider} (until SIGTERM)")
    add_database_options(serve)
    env_flag(serve, "--host", "POSTBOX_WEBHOOK_HOST", "address to listen on", default="0.0.0.0")  # noqa: S104
    env_flag(serve, "--port", "POSTBOX_WEBHOOK_PORT", "port for the webhook routes", type=int, default=8080)
    env_flag(
        serve,
        "--max-body-bytes",
        "POSTBOX_WEBHOOK_MAX_BODY_BYTES",
        "larger bodies get 413",
        type=int,
        default=1 << 20,
    )
    env_flag(serve, "--pool-size", "POSTBOX_WEBHOOK_POOL_SIZE", "database connections", type=int, default=10)
    env_flag(
        serve,
        "--read-timeout",
        "POSTBOX_WEBHOOK_READ_TIMEOUT",
        "seconds a client may take to send a request's headers, and again its body (else 408)",
        type=float,
        default=10.0,
    )
    env_flag(
        serve,
        "--max-connections",
        "POSTBOX_WEBHOOK_MAX_CONNECTIONS",
        "connections and requests at once; past it, 503 (kept below the file-descriptor limit)",
        type=int,
        default=1000,
    )
    env_flag(
        serve,
        "--metrics-address",
        "POSTBOX_METRICS_ADDRESS",
        "host:port for /metrics (not the webhook port; off when unset)",
    )
    serve.set_defaults(handler=_cmd_serve)

    work = sub.add_parser("work", help="process the webhook inbox with your handlers (until SIGTERM)")
    add_database_options(work, schema_default=None)
    env_flag(work, "--app", "POSTBOX_WEBHOOK_APP", "your handlers: module:attribute naming a Webhooks")
    env_flag(work, "--batch-size", "POSTBOX_BATCH_SIZE", "events claimed at a time", type=int, default=20)
    env_flag(
        work,
        "--poll-interval",
        "POSTBOX_POLL_INTERVAL",
        "seconds between polls when idle",
        type=float,
        default=0.5,
    )
    env_flag(
        work,
        "--reap-interval",
        "POSTBOX_REAP_INTERVAL",
        "seconds between reaper runs",
        type=float,
        default=10.0,
    )
    env_flag(
        work,
        "--metrics-address",
        "POSTBOX_METRICS_ADDRESS",
        "host:port for /metrics, /healthz, /readyz (off when unset)",
    )
    work.set_defaults(handler=_cmd_work)

    reconcile = sub.add_parser(
        "reconcile", help="re-fetch recent events from a provider's API into the inbox"
    )
    add_database_options(reconcile)
    env_flag(
        reconcile,
        "--app",
        "POSTBOX_RECONCILER",
        "module:attribute naming a Reconciler (or a function returning one)",
    )
    env_flag(
        reconcile,
        "--since",
        "POSTBOX_RECONCILE_SINCE",
        "how far back to look",
        type=duration,
        default=duration("3d"),
    )
    env_flag(
        reconcile,
        "--every",
        "POSTBOX_RECONCILE_EVERY",
        "repeat on this schedule (once when unset)",
        type=duration,
    )
    reconcile.set_defaults(handler=_cmd_reconcile)

    prune_hooks = sub.add_parser(
        "prune-webhooks", help="delete processed webhook rows older than a retention"
    )
    add_database_options(prune_hooks)
    env_flag(
        prune_hooks,
        "--older-than",
        "POSTBOX_WEBHOOK_RETENTION",
        "retention (keep it past the providers' replay windows)",
        type=duration,
        default=duration("60d"),
    )
    prune_hooks.set_defaults(handler=_cmd_prune_webhooks)

    prune = sub.add_parser("prune", help="delete inbox rows older than a retention, in small batches")
    add_database_options(prune)
    env_flag(
        prune,
        "--older-than",
        "POSTBOX_INBOX_RETENTION",
        "retention (keep it past the providers' replay windows)",
        type=duration,
        default=duration("60d"),
    )
    prune.set_defaults(handler=_cmd_prune)
    _add_status_commands(sub)


def _add_status_commands(sub: Any) -> None:
    """The operator's views: `status`, `status-webhooks`, `requeue-webhooks`."""
    status = sub.add_parser("status", help="per consumer: processed, parked, oldest parked, last processed")
    add_database_options(status)
    status.add_argument("--consumer", help="only this consumer (the Inbox's name)")
    status.add_argument(
        "--show-parked", type=int, default=10, metavar="N", help="list up to N parked messages"
    )
    status.set_defaults(handler=_cmd_status)

    hooks_status = sub.add_parser("status-webhooks", help="the webhook inbox by provider and status")
    add_database_options(hooks_status)
    hooks_status.add_argument(
        "--show-failed", type=int, default=10, metavar="N", help="list up to N failed events"
    )
    hooks_status.set_defaults(handler=_cmd_status_webhooks)

    requeue = sub.add_parser(
        "requeue-webhooks", help="failed webhook events back to pending, with their attempts reset"
    )
    add_database_options(requeue)
    requeue.add_argument("--provider", help="only this provider's events")
    requeue.add_argument("--id", dest="event_ids", action="append", help="an event id (repeatable)")
    requeue.add_argument("--event-type", help="only events of this type")
    requeue.add_argument("--error-like", help="only events whose last error matches this LIKE pattern")
    requeue.add_argument("--all", action="store_true", help="every failed event")
    requeue.set_defaults(handler=_cmd_requeue_webhooks)

    again = sub.add_parser(
        "requeue",
        help="parked Kafka messages read again from the broker and run through their handlers",
    )
    add_database_options(again, schema_default=None)
    env_flag(again, "--app", "POSTBOX_INBOX_APP", "your handlers: module:attribute naming an inbox.Inbox")
    env_flag(again, "--kafka-bootstrap", "POSTBOX_KAFKA_BOOTSTRAP", "Kafka bootstrap servers")
    again.add_argument(
        "--kafka-config", action="append", default=[], metavar="KEY=VALUE", help="librdkafka property"
    )
    again.add_argument("--id", dest="ids", action="append", help="a parked message's id (repeatable)")
    again.add_argument("--error-like", help="only messages whose reason matches this LIKE pattern")
    again.add_argument("--all", action="store_true", help="every parked message of the consumer")
    again.set_defaults(handler=_cmd_requeue)


def load_app(spec: str, kind: type[T] | None = None) -> T | Any:
    """The object `module:attribute` names, checked to be a `kind` when one is given."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--app {spec!r}: use module:attribute, e.g. billing.handlers:inbox")
    module = importlib.import_module(module_name)
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"--app {spec!r}: {module_name} has no attribute {attribute!r}") from None
    if kind is not None and not isinstance(found, kind):
        raise ValueError(
            f"--app {spec!r} is a {type(found).__name__}, not a {kind.__module__}.{kind.__name__}"
        )
    return found


def _load_inbox(args: argparse.Namespace) -> Any:
    """The app's Inbox, in the schema --schema names when given (else the one the Inbox names)."""
    from inbox.handlers import Inbox  # noqa: PLC0415

    app = load_app(args.app, Inbox)
    if args.schema:
        app.schema = args.schema
    return app


def _cmd_consume(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "app", "database_url", "kafka_bootstrap", "topics")
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from inbox.consumer import ConsumerSettings, InboxConsumer  # noqa: PLC0415
    from inbox.metrics import InboxMetrics  # noqa: PLC0415
    from relay.core.kafka_config import kafka_config_from  # noqa: PLC0415
    from relay.core.ops_http import serving  # noqa: PLC0415

    try:
        app = _load_inbox(args)
        settings = ConsumerSettings(
            database_url=args.database_url,
            kafka_bootstrap=args.kafka_bootstrap,
            topics=[t.strip() for t in args.topics.split(",") if t.strip()],
            group_id=args.group_id,
            batch_size=args.batch_size,
            max_batch_bytes=args.max_batch_bytes,
            kafka_config=kafka_config_from(args.kafka_config),
        )
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    registry = CollectorRegistry()
    consumer = InboxConsumer(app, settings, InboxMetrics(registry))
    consumer.install_signal_handlers()
    with serving(args.metrics_address, registry, consumer.healthy, consumer.ready):
        return consumer.run()


def _cmd_prune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from inbox.helpers import prune_inbox  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        deleted = prune_inbox(conn, args.older_than)
    print(f"pruned {deleted} inbox rows older than {args.older_than}")
    return 0


def _graceful_server_class() -> Any:
    import uvicorn  # noqa: PLC0415

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die by the signal;
        postbox daemons exit 0 after a clean stop. (It clears uvicorn's private list of captured signals,
        so a test checks the exit code.)"""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return GracefulServer


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    import uvicorn  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from psycopg_pool import AsyncConnectionPool  # noqa: PLC0415

    from inbox.webhooks.config import providers_from_env  # noqa: PLC0415
    from inbox.webhooks.receiver import ReceiverMetrics, WebhookReceiver  # noqa: PLC0415
    from inbox.webhooks.serving import (  # noqa: PLC0415
        SlowClientMetrics,
        connection_limit,
        protocol_with_header_deadline,
    )
    from relay.core.db import liveness_options  # noqa: PLC0415
    from relay.core.ops_http import serving  # noqa: PLC0415

    try:
        providers = providers_from_env()
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_body_bytes < 1024:
        parser.error("--max-body-bytes (POSTBOX_WEBHOOK_MAX_BODY_BYTES) must be at least 1024")
    if not 0.5 <= args.read_timeout <= 300:
        parser.error(
            f"--read-timeout (POSTBOX_WEBHOOK_READ_TIMEOUT) {args.read_timeout}s is outside 0.5..300"
        )
    if not 16 <= args.max_connections <= 100_000:
        parser.error(
            f"--max-connections (POSTBOX_WEBHOOK_MAX_CONNECTIONS) {args.max_connections}: outside 16..100000"
        )
    try:
        max_connections = connection_limit(args.max_connections)
    except ValueError as exc:
        parser.error(f"--max-connections: {exc}")
    registry = CollectorRegistry()
    # open=False: the pool opens in the app's lifespan, inside uvicorn's event loop. A database that is
    # down at start is not fatal: requests answer 503 until it is back.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        args.database_url,
        min_size=1,
        max_size=args.pool_size,
        open=False,
        timeout=5.0,
        kwargs={"application_name": "postbox-webhooks", **liveness_options(args.database_url)},
    )
    app = WebhookReceiver(
        providers,
        pool,
        args.schema,
        ReceiverMetrics(registry),
        args.max_body_bytes,
        read_timeout=args.read_timeout,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        http=protocol_with_header_deadline(
            args.read_timeout, SlowClientMetrics(registry), max_waiting=max(8, max_connections // 2)
        ),
        limit_concurrency=max_connections,
    )
    # /metrics on its own port; the receiver answers /healthz and /readyz on the webhook port itself.
    with serving(args.metrics_address, registry, lambda: (True, "ok"), lambda: (True, "ok")):
        _graceful_server_class()(config).run()
    return 0


def _cmd_work(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "app", "database_url")
    from inbox.webhooks.worker import Webhooks, WebhookWorker  # noqa: PLC0415

    try:
        hooks = load_app(args.app, Webhooks)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    if args.schema:
        hooks.schema = args.schema
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from inbox.webhooks.worker import WorkerMetrics  # noqa: PLC0415
    from relay.core.ops_http import serving  # noqa: PLC0415

    registry = CollectorRegistry()
    worker = WebhookWorker(
        hooks,
        args.database_url,
        args.batch_size,
        args.poll_interval,
        args.reap_interval,
        WorkerMetrics(registry),
    )
    worker.install_signal_handlers()
    with serving(args.metrics_address, registry, worker.healthy, worker.ready):
        return worker.run()


def _cmd_reconcile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "app", "database_url")
    import time  # noqa: PLC0415
    from datetime import UTC, datetime  # noqa: PLC0415

    from inbox.webhooks.reconcile import reconcile  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    try:
        target = load_app(args.app)
        reconciler = target() if callable(target) and not hasattr(target, "recent_events") else target
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    while True:
        since = datetime.now(UTC) - args.since
        with connect(args.database_url, args.schema) as conn:
            seen, new = reconcile(conn, reconciler, since)
        print(
            f"reconciled {reconciler.provider}: {seen} events since {since:%Y-%m-%d %H:%M:%S}Z, {new} new",
            flush=True,
        )
        if args.every is None:
            return 0
        time.sleep(args.every.total_seconds())


def _cmd_prune_webhooks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from inbox.webhooks.store import prune_webhooks  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        deleted = prune_webhooks(conn, args.older_than)
    print(f"pruned {deleted} webhook rows older than {args.older_than}")
    return 0


def _cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from inbox.admin import consumer_status, parked_messages  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema, autocommit=True) as conn:
        found = consumer_status(conn, args.consumer)
        parked = parked_messages(conn, args.consumer, args.show_parked)
    if not found:
        print("no inbox messages" + (f" for consumer {args.consumer!r}" if args.consumer else ""))
    for st in found:
        last = f"{st.last_processed:%Y-%m-%d %H:%M:%S%z}" if st.last_processed else "never"
        print(
            f"{st.consumer}: processed {st.processed}, parked {st.parked}"
            f" (oldest {st.oldest_parked_seconds:.0f} s), last processed {last}"
        )
    for consumer, message_id, topic, partition, offset, attempts, error in parked:
        print(
            f"  parked {consumer} {message_id} at {topic}/{partition}/{offset} attempts={attempts}: {error}"
        )
    return 0


def _cmd_status_webhooks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from inbox.admin import failed_webhooks, webhook_status  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema, autocommit=True) as conn:
        found = webhook_status(conn)
        failed = failed_webhooks(conn, args.show_failed)
    if not found:
        print("no webhook events")
    for provider, status, count, oldest in found:
        print(f"{provider:12} {status:10} {count:8} events, oldest {oldest:.0f} s")
    for provider, event_id, event_type, attempts, error in failed:
        print(f"  failed {provider} {event_id} {event_type} attempts={attempts}: {error}")
    return 0


def _cmd_requeue_webhooks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    if not (args.provider or args.event_ids or args.event_type or args.error_like or args.all):
        parser.error("say which failed events: --provider, --id, --event-type, --error-like, or --all")
    from inbox.admin import requeue_webhooks  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        done = requeue_webhooks(
            conn,
            provider=args.provider,
            event_ids=args.event_ids,
            event_type=args.event_type,
            error_like=args.error_like,
        )
    shown = ", ".join(f"{p}/{e}" for p, e in done[:50])
    print(f"requeued {len(done)} webhook events" + (f": {shown}" if done else ""))
    return 0


def _cmd_requeue(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "app", "database_url", "kafka_bootstrap")
    if not (args.ids or args.error_like or args.all):
        parser.error("say which parked messages: --id, --error-like, or --all")
    from inbox.consumer import ConsumerSettings, InboxConsumer  # noqa: PLC0415
    from relay.core.kafka_config import kafka_config_from  # noqa: PLC0415

    try:
        app = _load_inbox(args)
        settings = ConsumerSettings(
            database_url=args.database_url,
            kafka_bootstrap=args.kafka_bootstrap,
            topics=[],
            kafka_config=kafka_config_from(args.kafka_config),
        )
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    done = InboxConsumer(app, settings).requeue(ids=args.ids, error_like=args.error_like)
    print(
        f"requeued {len(done.applied) + len(done.parked_again) + len(done.gone)} parked messages of "
        f"{app.consumer}: {len(done.applied)} applied, {len(done.parked_again)} parked again, "
        f"{len(done.gone)} no longer on the broker"
    )
    for message_id, reason in done.parked_again:
        print(f"  parked again {message_id}: {reason}")
    for message_id in done.gone:
        print(f"  gone from the broker (retention or compaction), still parked: {message_id}")
    return 0
