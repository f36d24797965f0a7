"""`postbox capture ...`: publish the changes of business tables in Debezium's format."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from postbox.relay.core.settings import add_flags

TABLE_HELP = "the table, as SCHEMA.TABLE (or a name the search path finds)"


def add_capture_commands(commands: Any) -> None:
    from postbox.relay.capture.settings import (  # noqa: PLC0415
        CaptureAddSettings,
        CaptureSettings,
        CaptureSnapshotSettings,
    )

    capture = commands.add_parser(
        "capture",
        help="publish the changes of business tables as Debezium-format events (no replication slot)",
    )
    sub = capture.add_subparsers(dest="capture_command", metavar="CAPTURE_COMMAND", required=True)

    add = sub.add_parser(
        "add", help="capture a table's inserts, updates and deletes (again: change the settings)"
    )
    add_flags(add, CaptureAddSettings)
    add.add_argument("table", help=TABLE_HELP)
    only = add.add_mutually_exclusive_group()
    only.add_argument("--columns", type=_columns, metavar="A,B", help="capture only these columns")
    only.add_argument(
        "--exclude-columns", type=_columns, metavar="C,D", help="capture every column but these"
    )
    add.add_argument(
        "--key-columns",
        type=_columns,
        metavar="K",
        help="the columns of the message key (default: the primary key; a table without one needs this)",
    )
    add.set_defaults(handler=_cmd_add)

    listing = sub.add_parser("list", help="the captured tables, their topics and snapshots")
    add_flags(listing, CaptureSettings)
    listing.set_defaults(handler=_cmd_list)

    remove = sub.add_parser(
        "remove", help="stop capturing a table (events already written are still published)"
    )
    add_flags(remove, CaptureSettings)
    remove.add_argument("table", help=TABLE_HELP)
    remove.set_defaults(handler=_cmd_remove)

    snapshot = sub.add_parser(
        "snapshot",
        help="emit every existing row as a read event (op r), in chunks, while writers go on; resumes where "
        "an interrupted run stopped",
    )
    add_flags(snapshot, CaptureSnapshotSettings)
    snapshot.add_argument("table", help=TABLE_HELP)
    snapshot.add_argument("--restart", action="store_true", help="start again from the first row")
    snapshot.set_defaults(handler=_cmd_snapshot)


def _columns(text: str) -> list[str]:
    from postbox.relay.capture.admin import column_list  # noqa: PLC0415

    try:
        return column_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _refusals() -> tuple[type[Exception], ...]:
    """What the database answers a capture it will not make: no such table, no key, not a table, a bad
    option, no privilege, a table it cannot follow, a snapshot of a table not captured."""
    import psycopg  # noqa: PLC0415

    errors = psycopg.errors
    return (
        errors.DataError,
        errors.ProgrammingError,  # undefined table or column, no privilege, wrong object type
        errors.NotSupportedError,
        errors.ObjectNotInPrerequisiteState,
    )


def _refused(command: str, exc: Exception) -> int:
    """A capture the database refused (no such table, no key, a bad option): its message, exit 2."""
    import psycopg  # noqa: PLC0415

    message = str(exc).strip()
    if isinstance(exc, psycopg.Error) and exc.diag.message_hint:
        message = f"{exc.diag.message_primary}\n  hint: {exc.diag.message_hint}"
    print(f"postbox capture {command}: {message}", file=sys.stderr)
    return 2


def _cmd_add(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.capture.admin import CaptureOptions, add_capture  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    options = CaptureOptions(
        topic_prefix=settings.topic_prefix,
        columns=args.columns,
        exclude_columns=args.exclude_columns,
        key_columns=args.key_columns,
        tombstones_on_delete=settings.tombstones_on_delete,
        decimal_handling_mode=settings.decimal_handling_mode,
        time_precision_mode=settings.time_precision_mode,
    )
    with connect(settings.database_url, settings.schema) as conn:
        try:
            with conn.transaction():
                topic = add_capture(conn, settings.schema, args.table, options)
        except _refusals() as exc:
            return _refused("add", exc)
    print(f"capturing {args.table}: its changes go to topic {topic} from the next commit")
    return 0


def _cmd_list(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.capture.admin import list_captures  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        captures = list_captures(conn, settings.schema)
    if not captures:
        print("no table is captured (postbox capture add SCHEMA.TABLE)")
        return 0
    for c in captures:
        chosen = (
            f" columns={','.join(c.columns)}"
            if c.columns
            else f" exclude-columns={','.join(c.exclude_columns)}"
            if c.exclude_columns
            else ""
        )
        options = "".join(f" {name}={value}" for name, value in sorted(c.options.items()))
        print(
            f"{c.table} -> {c.topic}  key={','.join(c.key_columns)}{chosen}{options}  snapshot: {c.snapshot}"
        )
    return 0


def _cmd_remove(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.capture.admin import remove_capture  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    with connect(settings.database_url, settings.schema) as conn:
        try:
            with conn.transaction():
                removed = remove_capture(conn, settings.schema, args.table)
        except _refusals() as exc:
            return _refused("remove", exc)
    print(f"{args.table}: {'no longer captured' if removed else 'was not captured'}")
    return 0


def _cmd_snapshot(args: argparse.Namespace, settings: Any, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.capture.admin import snapshot  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    def progress(emitted: int) -> None:
        print(f"\r{args.table}: {emitted} rows emitted", end="", flush=True)

    with connect(settings.database_url, settings.schema) as conn:
        try:
            emitted = snapshot(
                conn,
                settings.schema,
                args.table,
                chunk_rows=settings.chunk_rows,
                restart=args.restart,
                progress=progress,
            )
        except _refusals() as exc:
            print()
            return _refused("snapshot", exc)
    print(f"\r{args.table}: snapshot done, {emitted} rows emitted as read events by this run")
    return 0
