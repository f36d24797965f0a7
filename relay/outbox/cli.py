"""`postbox relay ...`: run the daemon and operate the outbox."""

from __future__ import annotations

import argparse
from typing import Any

from postbox.relay.core.settings import DatabaseSettings, add_flags


def add_relay_commands(commands: Any) -> None:
    from postbox.relay.outbox.settings import PruneSettings, RelaySettings  # noqa: PLC0415

    relay = commands.add_parser("relay", help="publish outbox rows to Kafka, and operate the outbox")
    sub = relay.add_subparsers(dest="relay_command", metavar="RELAY_COMMAND", required=True)

    run = sub.add_parser("run", help="run the relay daemon (until SIGTERM)")
    add_flags(run, RelaySettings)
    run.set_defaults(handler=_cmd_run)

    status = sub.add_parser("status", help="backlog, oldest unpublished age, failed rows, shard owners")
    add_flags(status, DatabaseSettings)
    status.add_argument("--show-failed", type=int, default=10, metavar="N", help="list up to N failed rows")
    status.set_defaults(handler=_cmd_status)

    requeue = sub.add_parser("requeue", help="put failed (parked) rows back to pending")
    add_flags(requeue, DatabaseSettings)
    requeue.add_argument("--id", type=int, action="append", dest="ids", help="row id (repeatable)")
    requeue.add_argument("--aggregate-type", help="requeue the failed rows of this aggregate type")
    requeue.add_argument("--event-type", help="requeue the failed rows of this event type")
    requeue.add_argument("--error-like", help="SQL LIKE pattern on the recorded error")
    requeue.add_argument("--all", action="store_true", help="requeue every failed row")
    requeue.add_argument(
        "--stranded",
        action="store_true",
        help="queue the stranded rows instead: committed, but logged where no relay reads the log "
        "(`postbox relay status` names them)",
    )
    requeue.set_defaults(handler=_cmd_requeue)

    switch = sub.add_parser(
        "switch-mode",
        help="switch the outbox to log mode (append-only, read in commit order) or back to queue mode",
    )
    add_flags(switch, DatabaseSettings)
    switch.add_argument(
        "mode", choices=["log", "queue"], help="log: append-only, read in commit order; queue: claim and mark"
    )
    switch.set_defaults(handler=_cmd_switch_mode)

    rebase = sub.add_parser(
        "rebase",
        help="after the database moved to another cluster (dump and restore, logical replication): "
        "restart the outbox's log on this cluster, queueing every row not known to be published",
    )
    add_flags(rebase, DatabaseSettings)
    rebase.set_defaults(handler=_cmd_rebase)

    prune = sub.add_parser("prune", help="delete published rows older than a retention, in small batches")
    add_flags(prune, PruneSettings)
    prune.set_defaults(handler=_cmd_prune)


def _cmd_run(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    import structlog  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.ops_http import serving  # noqa: PLC0415
    from postbox.relay.core.tracing import start_daemon_tracing  # noqa: PLC0415
    from postbox.relay.outbox.daemon import FatalRelayError, Relay  # noqa: PLC0415
    from postbox.relay.outbox.metrics import RelayMetrics, record_librdkafka_statistics  # noqa: PLC0415
    from postbox.relay.outbox.publisher import KafkaPublisher  # noqa: PLC0415
    from postbox.relay.outbox.sources.base import RelayConfigurationError  # noqa: PLC0415

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

    # Before anything connects: an OTEL_* value postbox cannot honour is a usage error like a bad flag.
    tracing = start_daemon_tracing("relay", parser)
    registry = CollectorRegistry()
    metrics = RelayMetrics(registry)
    try:
        publisher = KafkaPublisher(
            settings.producer_config(),
            on_statistics=lambda stats: record_librdkafka_statistics(metrics, stats),
        )
    except Exception as exc:  # noqa: BLE001  (librdkafka rejects bad properties here; name them)
        parser.error(f"kafka-config: {exc}")
    delivery = None  # at least once, through `publisher`
    if settings.exactly_once:
        from postbox.relay.outbox.exactly_once.delivery import ExactlyOnce  # noqa: PLC0415
        from postbox.relay.outbox.exactly_once.transactions import Transactions  # noqa: PLC0415
        from postbox.relay.outbox.sources.queue import Claimer  # noqa: PLC0415

        transactions = Transactions(
            settings.transactional_config(),
            relay_id=settings.relay_id,
            metrics=metrics,
            # A group is opened on the relay's main loop, and a commit waits in a lane: either must leave
            # the leases time to be renewed.
            timeout=min(10.0, settings.lease_ttl / 3),
        )
        delivery = ExactlyOnce(transactions, Claimer.of(settings), settings.transactional_prefix)
    relay = Relay(settings, publisher, metrics, connect_db, tracing, delivery)
    relay.install_signal_handlers()
    log.info("relay_ops_listening", address=settings.metrics_address)
    with tracing, serving(settings.metrics_address, registry, relay.healthy, relay.ready):
        try:
            return relay.run()
        except FatalRelayError as exc:
            log.error("relay_fatal", error=str(exc))
            return 3
        except RelayConfigurationError as exc:
            log.error("relay_misconfigured", error=str(exc))
            return 2


def _cmd_status(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.sql import query  # noqa: PLC0415
    from postbox.relay.outbox.admin import QUERIES, foreign_log, log_progress, status  # noqa: PLC0415

    with connect(settings.database_url, settings.schema, autocommit=True) as conn:
        st = status(conn)
        progress = log_progress(conn) if st.log is not None else None
        moved = foreign_log(conn)
        failed = conn.execute(query(QUERIES, "failed_rows"), {"limit": args.show_failed}).fetchall()
    if moved is not None:
        print(f"NOT PUBLISHING: {moved}")
    # The first line counts every row still to publish, whichever the mode (the breakdown follows).
    print(f"backlog            {st.backlog} rows")
    print(f"oldest unpublished {st.oldest_unpublished_seconds:.1f} s")
    print(f"  pending          {st.pending} rows (claimed row by row)")
    if st.log is not None:
        print(
            f"  log unpublished  {st.log.rows} rows (logged, not yet read; "
            f"the oldest {st.log.oldest_seconds:.1f} s)"
        )
    stranded = st.stranded
    assert stranded is not None  # status() takes the census unless told not to
    print(f"  stranded         {stranded.rows} rows (committed, but where no relay reads the log)")
    if stranded.rows:
        shown = ", ".join(map(str, stranded.first_ids))
        more = " ..." if stranded.rows > len(stranded.first_ids) else ""
        print(f"    ids {shown}{more}: `postbox relay requeue --stranded` queues them")
    print(f"failed             {st.failed} rows")
    print(f"unowned shards     {st.unowned_shards} of 64")
    print(f"partitions         {st.partitions}, {st.partitions_finished} finished (emptied by pruning)")
    for owner, count, expires in st.owners:
        print(f"  {owner:40} {count:3} shards, lease ends in {expires:.1f} s")
    if progress is not None:
        lag = max(progress.cursor_lag_seconds.values(), default=0.0)
        print(f"log newest tick    {progress.tick_age_seconds:.1f} s ago")
        print(f"log cursor lag     {lag:.1f} s of ticks (the furthest-behind shard)")
        print(f"log oldest open tx {progress.oldest_open_transaction_seconds:.1f} s")
        if progress.shards_behind_switch:
            print(f"log not yet read to the switch to queue mode: {progress.shards_behind_switch} shards")
    for row in failed:
        print(
            f"  failed id={row[0]} event_id={row[1]} {row[2]}/{row[3]} {row[4]} attempts={row[5]}: {row[6]}"
        )
    return 0


def _cmd_requeue(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    filters = args.ids or args.aggregate_type or args.event_type or args.error_like or args.all
    if args.stranded and filters:
        parser.error("--stranded queues the stranded rows; it takes no filter of the failed rows")
    if not (filters or args.stranded):
        parser.error(
            "say which failed rows: --id, --aggregate-type, --event-type, --error-like, or --all "
            "(or --stranded for the stranded rows)"
        )
    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.outbox.admin import requeue, requeue_stranded  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        if args.stranded:
            ids = requeue_stranded(conn)
        else:
            ids = requeue(
                conn,
                ids=args.ids,
                aggregate_type=args.aggregate_type,
                event_type=args.event_type,
                error_like=args.error_like,
            )
    print(f"requeued {len(ids)} rows" + (f": {', '.join(map(str, ids[:50]))}" if ids else ""))
    return 0


def _cmd_switch_mode(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.outbox.admin import SwitchRefused, switch_mode  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        try:
            tick = switch_mode(conn, settings.schema, args.mode)
        except SwitchRefused as exc:
            print(f"not switched: {exc}")
            return 1
    if args.mode == "log":
        print(
            f"the outbox is in log mode from tick {tick}: start the relays (in --mode auto, the default, "
            "they follow it; a relay pinned with --mode queue refuses)"
        )
    else:
        print(
            f"the outbox is in queue mode from tick {tick}: start the relays; in --mode auto (the default) "
            "they read the rest of the log in log mode, then go on in queue mode (pinned ones: --mode log "
            "until `postbox relay status` no longer shows the log unread to the switch, then --mode queue)"
        )
    return 0


def _cmd_rebase(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.outbox.admin import NothingToRebase, SwitchRefused, rebase  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        try:
            done = rebase(conn, settings.schema)
        except (SwitchRefused, NothingToRebase) as exc:
            print(f"not rebased: {exc}")
            return 1
    print(
        f"the outbox's log starts again at tick {done.tick} on this cluster: {done.queued} rows queued "
        f"(unread, or not known to be read: published again at worst), {done.published} marked published; "
        "start the relays"
    )
    return 0


def _cmd_prune(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.outbox.admin import prune  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        pruned = prune(conn, settings.older_than, batch_size=settings.batch_size)
    print(
        f"pruned {pruned.rows} published rows older than {settings.older_than}; emptied "
        f"{pruned.partitions.emptied} finished outbox partitions (dropped {pruned.partitions.dropped}, "
        f"{pruned.partitions.parked_moved} parked rows kept in outbox_parked)"
    )
    return 0
