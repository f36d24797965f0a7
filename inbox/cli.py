"""`postbox inbox ...`: run a service's inbox consumer, and keep the inbox table trimmed."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, TypeVar

from postbox.relay.core.operator_errors import SCHEMA_IN_USE
from postbox.relay.core.settings import DatabaseSettings, Settings, add_flags, load
from postbox.relay.core.tracing import start_daemon_tracing

T = TypeVar("T")


def add_inbox_commands(commands: Any) -> None:
    from postbox.inbox import settings as declared  # noqa: PLC0415

    inbox = commands.add_parser("inbox", help="consume Kafka topics idempotently into PostgreSQL")
    sub = inbox.add_subparsers(dest="inbox_command", metavar="INBOX_COMMAND", required=True)

    consume = sub.add_parser("consume", help="run an inbox consumer (until SIGTERM)")
    add_flags(consume, declared.ConsumeSettings)
    consume.set_defaults(handler=_cmd_consume)

    serve = sub.add_parser("serve", help="the webhook receiver: POST /webhooks/{provider} (until SIGTERM)")
    add_flags(serve, declared.ServeSettings)
    serve.set_defaults(handler=_cmd_serve)

    work = sub.add_parser("work", help="process the webhook inbox with your handlers (until SIGTERM)")
    add_flags(work, declared.WorkSettings)
    work.set_defaults(handler=_cmd_work)

    reconcile = sub.add_parser(
        "reconcile", help="re-fetch recent events from a provider's API into the inbox"
    )
    add_flags(reconcile, declared.ReconcileSettings)
    reconcile.set_defaults(handler=_cmd_reconcile)

    prune_hooks = sub.add_parser(
        "prune-webhooks", help="delete processed webhook rows older than a retention"
    )
    add_flags(prune_hooks, declared.WebhookPruneSettings)
    prune_hooks.set_defaults(handler=_cmd_prune_webhooks)

    prune = sub.add_parser("prune", help="delete inbox rows older than a retention, in small batches")
    add_flags(prune, declared.InboxPruneSettings)
    prune.set_defaults(handler=_cmd_prune)
    _add_status_commands(sub, declared.RequeueSettings)


def _add_status_commands(sub: Any, requeue_settings: type[Settings]) -> None:
    """The operator's views: `status`, `requeue`, `status-webhooks`, `requeue-webhooks`."""
    status = sub.add_parser(
        "status", help="per consumer: messages done and failed, the oldest failed, the last processing time"
    )
    add_flags(status, DatabaseSettings)
    status.add_argument("--consumer", help="only this consumer (the Inbox's name)")
    status.add_argument(
        "--show-failed", type=int, default=10, metavar="N", help="list up to N failed messages"
    )
    status.set_defaults(handler=_cmd_status)

    hooks_status = sub.add_parser("status-webhooks", help="the webhook inbox by provider and status")
    add_flags(hooks_status, DatabaseSettings)
    hooks_status.add_argument(
        "--show-failed", type=int, default=10, metavar="N", help="list up to N failed events"
    )
    hooks_status.set_defaults(handler=_cmd_status_webhooks)

    requeue = sub.add_parser(
        "requeue-webhooks", help="failed webhook events back to pending, with their attempts reset"
    )
    add_flags(requeue, DatabaseSettings)
    requeue.add_argument("--provider", help="only this provider's events")
    requeue.add_argument("--id", dest="event_ids", action="append", help="an event id (repeatable)")
    requeue.add_argument("--event-type", help="only events of this type")
    requeue.add_argument("--error-like", help="only events whose last error matches this LIKE pattern")
    requeue.add_argument("--all", action="store_true", help="every failed event")
    requeue.set_defaults(handler=_cmd_requeue_webhooks)

    again = sub.add_parser(
        "requeue",
        help="failed (parked) Kafka messages read again from the broker and run through their handlers",
    )
    add_flags(again, requeue_settings)
    again.add_argument("--id", dest="ids", action="append", help="a failed message's id (repeatable)")
    again.add_argument("--error-like", help="only messages whose reason matches this LIKE pattern")
    again.add_argument("--all", action="store_true", help="every failed message of the consumer")
    again.set_defaults(handler=_cmd_requeue)


def load_app(spec: str, kind: type[T] | None = None) -> T | Any:
    """The object `module:attribute` names, checked to be a `kind` when one is given."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--app {spec!r}: use module:attribute, e.g. billing.handlers:inbox")
    # The service's own modules are found from the directory it is started in, as uvicorn and celery do:
    # `postbox` is an installed script, so its sys.path holds only its own directory, not the current one.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module was found; something it imports is missing: that error says what
        raise ValueError(
            f"--app {spec!r}: cannot import {exc.name}: no module of that name in the current directory "
            f"({here}) or the installed packages"
        ) from None
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"--app {spec!r}: {module_name} has no attribute {attribute!r}") from None
    if kind is not None and not isinstance(found, kind):
        raise ValueError(
            f"--app {spec!r} is a {type(found).__name__}, not a {kind.__module__}.{kind.__name__}"
        )
    return found


def _load_inbox(settings: Any) -> Any:
    """The app's Inbox, in the schema --schema names when given (else the one the Inbox names)."""
    from postbox.inbox.handlers import Inbox  # noqa: PLC0415

    app = load_app(settings.app, Inbox)
    if settings.schema:
        app.schema = settings.schema
    SCHEMA_IN_USE.set(app.schema)  # so an unmigrated schema's message names it (relay.cli's dispatch)
    return app


def _cmd_consume(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from postbox.inbox.consumer import InboxConsumer  # noqa: PLC0415
    from postbox.inbox.metrics import InboxMetrics  # noqa: PLC0415
    from postbox.relay.core.ops_http import serving  # noqa: PLC0415

    try:
        app = _load_inbox(settings)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    tracing = start_daemon_tracing("inbox", parser)
    registry = CollectorRegistry()
    consumer = InboxConsumer(app, settings, InboxMetrics(registry), tracing.tracer)
    consumer.install_signal_handlers()
    with tracing, serving(settings.metrics_address, registry, consumer.healthy, consumer.ready):
        return consumer.run()


def _cmd_prune(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.helpers import prune_inbox  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        deleted = prune_inbox(conn, settings.older_than, include_failed=settings.include_failed)
    kept = "" if settings.include_failed else " (parked ones kept: --include-failed deletes them too)"
    print(f"pruned {deleted} inbox rows older than {settings.older_than}{kept}")
    return 0


def _cmd_serve(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.webhooks import assemble  # noqa: PLC0415
    from postbox.inbox.webhooks.config import providers_from  # noqa: PLC0415
    from postbox.inbox.webhooks.serving import connection_limit  # noqa: PLC0415

    try:
        providers_from(settings, os.environ)  # checked here, so a bad secret fails the start at once
    except ValueError as exc:
        parser.error(str(exc))
    try:
        max_connections = connection_limit(settings.max_connections)
    except ValueError as exc:
        parser.error(f"{settings.label('max_connections')}: {exc}")
    # Checked here, before anything starts; with --workers each process starts its own.
    tracing = start_daemon_tracing("receiver", parser)
    assemble.stop_if_refused(settings)
    if settings.workers == 1:
        return assemble.serve_one(settings, max_connections, tracing)
    tracing.shutdown()
    from postbox.relay.core.logging import LoggingSettings  # noqa: PLC0415

    logging = load(LoggingSettings, args, os.environ).settings  # what each receiver process logs with
    return assemble.serve_processes(settings, max_connections, logging.format, logging.level)


def _cmd_work(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.webhooks.worker import Webhooks, WebhookWorker  # noqa: PLC0415

    try:
        hooks = load_app(settings.app, Webhooks)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    if settings.schema:
        hooks.schema = settings.schema
    SCHEMA_IN_USE.set(hooks.schema)
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from postbox.inbox.webhooks.worker import WorkerMetrics  # noqa: PLC0415
    from postbox.relay.core.ops_http import serving  # noqa: PLC0415

    tracing = start_daemon_tracing("webhook-worker", parser)
    registry = CollectorRegistry()
    worker = WebhookWorker(
        hooks,
        settings.database_url,
        settings.batch_size,
        settings.poll_interval,
        settings.reap_interval,
        WorkerMetrics(registry),
        tracing.tracer,
    )
    worker.install_signal_handlers()
    with tracing, serving(settings.metrics_address, registry, worker.healthy, worker.ready):
        return worker.run()


def _cmd_reconcile(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from datetime import UTC, datetime  # noqa: PLC0415

    from postbox.inbox.webhooks.reconcile import reconcile  # noqa: PLC0415
    from postbox.relay.core.daemon import Daemon  # noqa: PLC0415
    from postbox.relay.core.db import connect, transient_database_error  # noqa: PLC0415

    try:
        target = load_app(settings.app)
        # A factory (a class, or a function returning one) is called; a ready Reconciler is used as it is.
        factory = isinstance(target, type) or not hasattr(target, "recent_events")
        reconciler = target() if callable(target) and factory else target
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))

    def reconcile_once() -> None:
        since = datetime.now(UTC) - settings.since
        with connect(settings.database_url, settings.schema) as conn:
            seen, new = reconcile(conn, reconciler, since)
        print(
            f"reconciled {reconciler.provider}: {seen} events since {since:%Y-%m-%d %H:%M:%S}Z, {new} new",
            flush=True,
        )

    if settings.every is None:
        reconcile_once()
        return 0
    # On a schedule it is a daemon like the others: it stops on SIGTERM (also mid-wait), and a lost
    # database only delays the next pass.
    daemon = Daemon("reconciler", stall_limit=settings.every.total_seconds() + 600)
    daemon.install_signal_handlers()

    def scheduled() -> None:
        reconcile_once()
        daemon.sleep(settings.every.total_seconds())

    return daemon.run(scheduled, lost=transient_database_error, on_lost=lambda _exc: None)


def _cmd_prune_webhooks(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.webhooks.store import prune_webhooks  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        deleted = prune_webhooks(conn, settings.older_than, include_failed=settings.include_failed)
    kept = "" if settings.include_failed else " (failed ones kept: --include-failed deletes them too)"
    print(f"pruned {deleted} webhook rows older than {settings.older_than}{kept}")
    return 0


def _cmd_status(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.admin import consumer_status, failed_messages  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema, autocommit=True) as conn:
        found = consumer_status(conn, args.consumer)
        failed = failed_messages(conn, args.consumer, args.show_failed)
    if not found:
        print("no inbox messages" + (f" for consumer {args.consumer!r}" if args.consumer else ""))
    for st in found:
        last = f"{st.last_processed:%Y-%m-%d %H:%M:%S%z}" if st.last_processed else "never"
        print(
            f"{st.consumer}: done {st.done}, failed {st.failed}"
            f" (oldest {st.oldest_failed_seconds:.0f} s), last processed {last}"
        )
    for consumer, message_id, topic, partition, offset, attempts, error in failed:
        print(
            f"  failed {consumer} {message_id} at {topic}/{partition}/{offset} attempts={attempts}: {error}"
        )
    return 0


def _cmd_status_webhooks(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.inbox.admin import failed_webhooks, webhook_status  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema, autocommit=True) as conn:
        found = webhook_status(conn)
        failed = failed_webhooks(conn, args.show_failed)
    if not found:
        print("no webhook events")
    for provider, status, count, oldest in found:
        print(f"{provider:12} {status:10} {count:8} events, oldest {oldest:.0f} s")
    for provider, event_id, event_type, attempts, error in failed:
        print(f"  failed {provider} {event_id} {event_type} attempts={attempts}: {error}")
    return 0


def _cmd_requeue_webhooks(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    if not (args.provider or args.event_ids or args.event_type or args.error_like or args.all):
        parser.error("say which failed events: --provider, --id, --event-type, --error-like, or --all")
    from postbox.inbox.admin import requeue_webhooks  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
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


def _cmd_requeue(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    if not (args.ids or args.error_like or args.all):
        parser.error("say which failed messages: --id, --error-like, or --all")
    from postbox.inbox.consumer import ConsumerSettings, InboxConsumer  # noqa: PLC0415

    try:
        app = _load_inbox(settings)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    consumer_settings = ConsumerSettings(
        database_url=settings.database_url,
        kafka_bootstrap=settings.kafka_bootstrap,
        kafka_config=settings.kafka_config,
    )
    done = InboxConsumer(app, consumer_settings).requeue(ids=args.ids, error_like=args.error_like)
    print(
        f"requeued {len(done.applied) + len(done.failed_again) + len(done.gone)} failed messages of "
        f"{app.consumer}: {len(done.applied)} applied, {len(done.failed_again)} failed again, "
        f"{len(done.gone)} no longer on the broker"
    )
    for message_id, reason in done.failed_again:
        print(f"  failed again {message_id}: {reason}")
    for message_id in done.gone:
        print(f"  gone from the broker (retention or compaction), still failed: {message_id}")
    return 0
