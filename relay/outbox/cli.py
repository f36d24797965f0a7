"""`postbox relay ...`: run the daemon and operate the outbox."""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Any

from relay.core.cli_options import add_database_options, duration, env_flag, require


def add_relay_commands(commands: Any) -> None:
    relay = commands.add_parser("relay", help="publish outbox rows to Kafka, and operate the outbox")
    sub = relay.add_subparsers(dest="relay_command", metavar="RELAY_COMMAND", required=True)

    run = sub.add_parser("run", help="run the relay daemon (until SIGTERM)")
    add_database_options(run)
    env_flag(run, "--kafka-bootstrap", "POSTBOX_KAFKA_BOOTSTRAP", "Kafka bootstrap servers (host:port,...)")
    run.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="librdkafka property, repeatable (SASL, TLS...); also settable as "
        "POSTBOX_RDKAFKA_<NAME> with dots written as underscores",
    )
    env_flag(run, "--relay-id", "POSTBOX_RELAY_ID", "this replica's id (default: hostname-pid)")
    env_flag(run, "--batch-size", "POSTBOX_BATCH_SIZE", "rows claimed per batch", type=int, default=1000)
    env_flag(
        run,
        "--lanes",
        "POSTBOX_RELAY_LANES",
        "batches in flight at once, each on its own shards and database connection: while one waits "
        "for Kafka's acks the next is claimed and produced (1 = one batch at a time)",
        type=int,
        default=2,
    )
    env_flag(
        run,
        "--max-batch-bytes",
        "POSTBOX_RELAY_MAX_BATCH_BYTES",
        "bytes of messages one claim loads (per lane; a batch is cut short there, the first row always "
        "comes); rows over the producer's message.max.bytes are parked without being loaded",
        type=int,
        default=16 << 20,
    )
    env_flag(
        run,
        "--poll-interval",
        "POSTBOX_POLL_INTERVAL",
        "seconds between polls when idle",
        type=float,
        default=1.0,
    )
    env_flag(
        run,
        "--no-listen",
        "POSTBOX_NO_LISTEN",
        "do not LISTEN for NOTIFY wake-ups (poll only)",
        action="store_true",
    )
    env_flag(
        run,
        "--lease-ttl",
        "POSTBOX_LEASE_TTL",
        "seconds a shard lease lasts without renewal",
        type=float,
        default=15.0,
    )
    env_flag(
        run,
        "--delivery-timeout",
        "POSTBOX_DELIVERY_TIMEOUT",
        "seconds Kafka may take to acknowledge (message.timeout.ms)",
        type=float,
        default=20.0,
    )
    env_flag(
        run,
        "--topic-template",
        "POSTBOX_TOPIC_TEMPLATE",
        "topic for rows without an explicit topic",
        default="outbox.event.{aggregate_type}",
    )
    env_flag(
        run,
        "--prune-retention",
        "POSTBOX_PRUNE_RETENTION",
        "delete published rows older than this (e.g. 7d) while running; off when unset",
        type=duration,
    )
    env_flag(
        run,
        "--delete-on-publish",
        "POSTBOX_DELETE_ON_PUBLISH",
        "delete each row once Kafka has acknowledged it, in the statement that would mark it published "
        "(cheaper than an update; no published rows are kept for audit or replay)",
        action="store_true",
    )
    env_flag(
        run,
        "--prune-interval",
        "POSTBOX_PRUNE_INTERVAL",
        "seconds between the daemon's pruning runs (with --prune-retention)",
        type=float,
        default=60.0,
    )
    env_flag(
        run,
        "--event-type-header",
        "POSTBOX_EVENT_TYPE_HEADER",
        "also send the event type in this header, which the inbox dispatches on; Debezium consumers "
        "ignore it ('' turns it off: the Debezium router's exact default format)",
        default="eventType",
    )
    env_flag(
        run,
        "--topic-recheck-interval",
        "POSTBOX_TOPIC_RECHECK_INTERVAL",
        "seconds between checks of a topic held back by a configuration error",
        type=float,
        default=30.0,
    )
    env_flag(
        run,
        "--metrics-address",
        "POSTBOX_METRICS_ADDRESS",
        "host:port for /metrics, /healthz, /readyz",
        default="0.0.0.0:9400",
    )
    run.set_defaults(handler=_cmd_run)

    status = sub.add_parser("status", help="backlog, oldest unpublished age, parked rows, shard owners")
    add_database_options(status)
    env_flag(
        status,
        "--show-parked",
        "POSTBOX_SHOW_PARKED",
        "list up to this many parked rows",
        type=int,
        default=10,
    )
    status.set_defaults(handler=_cmd_status)

    requeue = sub.add_parser("requeue", help="put parked (failed) rows back to pending")
    add_database_options(requeue)
    requeue.add_argument("--id", type=int, action="append", dest="ids", help="row id (repeatable)")
    requeue.add_argument("--aggregate-type")
    requeue.add_argument("--event-type")
    requeue.add_argument("--error-like", help="SQL LIKE pattern on the recorded error")
    requeue.add_argument("--all", action="store_true", help="requeue every parked row")
    requeue.set_defaults(handler=_cmd_requeue)

    prune = sub.add_parser("prune", help="delete published rows older than a retention, in small batches")
    add_database_options(prune)
    env_flag(
        prune,
        "--older-than",
        "POSTBOX_PRUNE_RETENTION",
        "retention, e.g. 7d",
        type=duration,
        default=timedelta(days=7),
    )
    env_flag(prune, "--batch-size", "POSTBOX_PRUNE_BATCH_SIZE", "rows per delete", type=int, default=1000)
    prune.set_defaults(handler=_cmd_prune)


def settings_from_args(args: argparse.Namespace) -> Any:
    """The RelaySettings `relay run` would start with; SettingsError or ValueError names a bad setting.
    `postbox config check` validates through this too, so both judge the same settings."""
    from relay.core.kafka_config import kafka_config_from  # noqa: PLC0415
    from relay.outbox.settings import RelaySettings  # noqa: PLC0415

    kafka_config = kafka_config_from(args.kafka_config)
    extra = {"relay_id": args.relay_id} if args.relay_id else {}
    return RelaySettings(
        database_url=args.database_url or "",
        kafka_bootstrap=args.kafka_bootstrap or "",
        schema=args.schema,
        batch_size=args.batch_size,
        lanes=args.lanes,
        max_batch_bytes=args.max_batch_bytes,
        poll_interval=args.poll_interval,
        listen=not args.no_listen,
        lease_ttl=args.lease_ttl,
        delivery_timeout=args.delivery_timeout,
        topic_template=args.topic_template,
        prune_retention=args.prune_retention,
        delete_on_publish=args.delete_on_publish,
        prune_interval=args.prune_interval,
        topic_recheck_interval=args.topic_recheck_interval,
        event_type_header=args.event_type_header,
        kafka_config=kafka_config,
        **extra,
    )


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from relay.outbox.settings import SettingsError  # noqa: PLC0415

    try:
        return settings_from_args(args)
    except (SettingsError, ValueError) as exc:
        parser.error(str(exc))


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    settings = _settings(args, parser)
    if not args.metrics_address.rpartition(":")[2].isdigit():
        parser.error(f"--metrics-address {args.metrics_address!r} is not host:port")
    import structlog  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from relay.core.db import connect  # noqa: PLC0415
    from relay.core.ops_http import serving  # noqa: PLC0415
    from relay.outbox.daemon import FatalRelayError, Relay, RelayConfigurationError  # noqa: PLC0415
    from relay.outbox.metrics import RelayMetrics, record_librdkafka_statistics  # noqa: PLC0415
    from relay.outbox.publisher import KafkaPublisher  # noqa: PLC0415

    log = structlog.get_logger("postbox.relay")
    # A relay paused (or cut off) mid-batch must not hold its row and shard locks forever: the server ends
    # such a session once it sits idle in a transaction longer than any batch legitimately can.
    idle_ms = str(int((settings.delivery_timeout + 30) * 1000))

    def connect_db(autocommit: bool) -> Any:
        return connect(
            settings.database_url,
            settings.schema,
            autocommit=autocommit,
            application_name=f"postbox-relay {settings.relay_id}",
            idle_in_transaction_session_timeout=idle_ms,
        )

    registry = CollectorRegistry()
    metrics = RelayMetrics(registry)
    try:
        publisher = KafkaPublisher(
            settings.producer_config(),
            on_statistics=lambda stats: record_librdkafka_statistics(metrics, stats),
        )
    except Exception as exc:  # noqa: BLE001  (librdkafka rejects bad properties here; name them)
        parser.error(f"kafka-config: {exc}")
    relay = Relay(settings, publisher, metrics, connect_db)
    relay.install_signal_handlers()
    log.info("relay_ops_listening", address=args.metrics_address)
    with serving(args.metrics_address, registry, relay.healthy, relay.ready):
        try:
            return relay.run()
        except FatalRelayError as exc:
            log.error("relay_fatal", error=str(exc))
            return 3
        except RelayConfigurationError as exc:
            log.error("relay_misconfigured", error=str(exc))
            return 2


def _cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from relay.core.db import connect  # noqa: PLC0415
    from relay.core.sql import query  # noqa: PLC0415
    from relay.outbox.admin import QUERIES, status  # noqa: PLC0415

    with connect(args.database_url, args.schema, autocommit=True) as conn:
        st = status(conn)
        parked = conn.execute(query(QUERIES, "parked_rows"), {"limit": args.show_parked}).fetchall()
    print(f"backlog            {st.backlog} rows")
    print(f"oldest unpublished {st.oldest_pending_seconds:.1f} s")
    print(f"parked (failed)    {st.parked} rows")
    print(f"unowned shards     {st.unowned_shards} of 64")
    for owner, count, expires in st.owners:
        print(f"  {owner:40} {count:3} shards, lease ends in {expires:.1f} s")
    for row in parked:
        print(
            f"  parked id={row[0]} event_id={row[1]} {row[2]}/{row[3]} {row[4]} attempts={row[5]}: {row[6]}"
        )
    return 0


def _cmd_requeue(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    if not (args.ids or args.aggregate_type or args.event_type or args.error_like or args.all):
        parser.error("say which parked rows: --id, --aggregate-type, --event-type, --error-like, or --all")
    from relay.core.db import connect  # noqa: PLC0415
    from relay.outbox.admin import requeue  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        ids = requeue(
            conn,
            ids=args.ids,
            aggregate_type=args.aggregate_type,
            event_type=args.event_type,
            error_like=args.error_like,
        )
    print(f"requeued {len(ids)} rows" + (f": {', '.join(map(str, ids[:50]))}" if ids else ""))
    return 0


def _cmd_prune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    from relay.core.db import connect  # noqa: PLC0415
    from relay.outbox.admin import prune  # noqa: PLC0415

    with connect(args.database_url, args.schema) as conn:
        deleted = prune(conn, args.older_than, batch_size=args.batch_size)
    print(f"pruned {deleted} published rows older than {args.older_than}", file=sys.stdout)
    return 0
