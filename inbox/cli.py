"""`postbox inbox ...`: run a service's inbox consumer, and keep the inbox table trimmed."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from relay.core.cli_options import add_database_options, duration, env_flag, require


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


def load_app(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--app {spec!r}: use module:attribute, e.g. billing.handlers:inbox")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"--app {spec!r}: {module_name} has no attribute {attribute!r}") from None


def _cmd_consume(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "app", "database_url", "kafka_bootstrap", "topics")
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from inbox.consumer import ConsumerSettings, InboxConsumer  # noqa: PLC0415
    from inbox.handlers import Inbox  # noqa: PLC0415
    from inbox.metrics import InboxMetrics  # noqa: PLC0415
    from relay.core.kafka_config import kafka_config_from  # noqa: PLC0415
    from relay.core.ops_http import OpsServer  # noqa: PLC0415

    try:
        app = load_app(args.app)
        if not isinstance(app, Inbox):
            raise ValueError(f"--app {args.app!r} is a {type(app).__name__}, not an inbox.Inbox")
        if args.schema:
            app.schema = args.schema
        settings = ConsumerSettings(
            database_url=args.database_url,
            kafka_bootstrap=args.kafka_bootstrap,
            topics=[t.strip() for t in args.topics.split(",") if t.strip()],
            group_id=args.group_id,
            batch_size=args.batch_size,
            kafka_config=kafka_config_from(args.kafka_config),
        )
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    registry = CollectorRegistry()
    consumer = InboxConsumer(app, settings, InboxMetrics(registry))
    consumer.install_signal_handlers()
    ops = None
    if args.metrics_address:
        host, _, port = args.metrics_address.rpartition(":")
        ops = OpsServer(host, int(port), registry, consumer.healthy, consumer.ready).start()
    try:
        return consumer.run()
    finally:
        if ops is not None:
            ops.stop()


def _cmd_prune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from inbox.helpers import prune_inbox  # noqa: PLC0415
    from relay.core.db import connect  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        deleted = prune_inbox(conn, args.older_than)
    print(f"pruned {deleted} inbox rows older than {args.older_than}")
    return 0
