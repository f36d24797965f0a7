"""The `postbox` command. Subcommands import their heavy modules lazily so `postbox --help` stays quick.

Each command declares its settings as a dataclass (relay.core.settings); main() loads that command's
settings, and only those, after parsing, and hands them to the command."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from relay import __version__
from relay.core.logging import LoggingSettings
from relay.core.settings import Settings, SettingsError, add_flags, load
from relay.devstack.settings import DemoSettings, StackChoice, StackSettings

if TYPE_CHECKING:
    from relay.outbox.settings import MigrateSettings

Handler = Callable[[argparse.Namespace, Any, argparse.ArgumentParser], int]


def services() -> dict[str, type[Settings]]:
    """The daemons `postbox config check --service` and the README's tables describe."""
    from inbox.settings import ConsumeSettings, ServeSettings, WorkSettings  # noqa: PLC0415
    from relay.outbox.settings import RelaySettings  # noqa: PLC0415

    return {
        "relay": RelaySettings,
        "inbox": ConsumeSettings,
        "webhook-worker": WorkSettings,
        "receiver": ServeSettings,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="postbox",
        description="Transactional-outbox relay and idempotent inbox for PostgreSQL and Apache Kafka.",
    )
    parser.add_argument("--version", action="version", version=f"postbox {__version__}")
    add_flags(parser, LoggingSettings, command=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from relay.outbox.settings import MigrateSettings  # noqa: PLC0415

    migrate = commands.add_parser("migrate", help="create or upgrade the postbox tables in a schema")
    add_flags(migrate, MigrateSettings)
    migrate.set_defaults(handler=_cmd_migrate)

    dev = commands.add_parser("dev", help="a real local PostgreSQL and Kafka for trying postbox (no Docker)")
    dev_commands = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND", required=True)
    up = dev_commands.add_parser("up", help="start PostgreSQL and Kafka, apply the schema, wait for Ctrl-C")
    add_flags(up, StackSettings)
    up.set_defaults(handler=_cmd_dev_up)
    demo = dev_commands.add_parser("demo", help="the relay on the local stack with sample traffic to watch")
    add_flags(demo, DemoSettings)
    demo.set_defaults(handler=_cmd_dev_demo)
    env = dev_commands.add_parser("env", help="print the connection settings of a running local stack")
    add_flags(env, StackChoice)
    env.set_defaults(handler=_cmd_dev_env)

    config = commands.add_parser("config", help="check the configuration")
    config_commands = config.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND", required=True)
    check = config_commands.add_parser(
        "check",
        help="validate a service's settings and print them with where each came from, secrets masked "
        "(exit 1 when one is invalid); without --service, every service",
    )
    check.add_argument("--service", choices=["relay", "inbox", "webhook-worker", "receiver"])
    check.set_defaults(handler=_cmd_config_check)
    reference = config_commands.add_parser(
        "reference", help="a service's settings as a Markdown table (the README's tables are these)"
    )
    reference.add_argument(
        "--service", choices=["relay", "inbox", "webhook-worker", "receiver"], required=True
    )
    reference.set_defaults(handler=_cmd_config_reference)

    from relay.outbox.cli import add_relay_commands  # noqa: PLC0415

    add_relay_commands(commands)
    from inbox.cli import add_inbox_commands  # noqa: PLC0415

    add_inbox_commands(commands)
    return parser


def _cmd_migrate(args: argparse.Namespace, settings: MigrateSettings, parser: argparse.ArgumentParser) -> int:
    import psycopg  # noqa: PLC0415

    from relay.core.migrate import created_by  # noqa: PLC0415
    from relay.outbox.admin import migrate_schema  # noqa: PLC0415

    with psycopg.connect(settings.database_url) as conn:
        applied = migrate_schema(conn, settings.schema, settings.new_outbox_mode)
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none (already up to date)"
    print(f"schema {settings.schema}: applied {names}")
    if created_by(applied):
        print(f"the new outbox is in {settings.new_outbox_mode} mode")
    return 0


def _cmd_dev_up(args: argparse.Namespace, settings: StackSettings, parser: argparse.ArgumentParser) -> int:
    import signal  # noqa: PLC0415

    import psycopg  # noqa: PLC0415

    from relay.devstack.stack import local_stack, read_state  # noqa: PLC0415
    from relay.outbox.admin import migrate_schema  # noqa: PLC0415

    if read_state(settings.name) is not None:
        parser.error(f"a stack named {settings.name!r} is already running; give this one another --name")
    print("starting PostgreSQL and Kafka (the first start fetches the Kafka jars with Maven)...", flush=True)
    stack = local_stack(
        pg=settings.postgres, kafka_nodes=settings.kafka_nodes, publish_state=True, name=settings.name
    )
    with stack as (_, _, info):
        with psycopg.connect(info.database_url) as conn:
            migrate_schema(conn, settings.schema, "log")  # as `postbox migrate` makes a new outbox
        print(f"PostgreSQL {info.postgres_version}  {info.database_url}")
        print(f"Kafka {info.kafka_version}      {info.kafka_bootstrap}")
        env_command = "postbox dev env" + ("" if settings.name == "default" else f" --name {settings.name}")
        print(f'schema {settings.schema} is migrated. In another terminal:  eval "$({env_command})"')
        print("Ctrl-C stops both servers and deletes their data.", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


def _cmd_dev_demo(args: argparse.Namespace, settings: DemoSettings, parser: argparse.ArgumentParser) -> int:
    from relay.devstack.demo import run_demo  # noqa: PLC0415

    return run_demo(settings.duration, settings.rate)


def _cmd_dev_env(args: argparse.Namespace, settings: StackChoice, parser: argparse.ArgumentParser) -> int:
    from relay.devstack.stack import read_state, running_stacks  # noqa: PLC0415

    info = read_state(settings.name)
    if info is None:
        others = running_stacks()
        hint = (
            f"; running: {', '.join(others)} (use --name)" if others else " (start one with `postbox dev up`)"
        )
        print(f"postbox: no local stack named {settings.name!r} is running{hint}", file=sys.stderr)
        return 1
    versions = f"PostgreSQL {info.postgres_version}, Kafka {info.kafka_version}"
    print(f"# postbox dev stack {settings.name!r}: {versions}")
    for name, value in info.as_env().items():
        print(f"export {name}={value}")
    return 0


def _cmd_config_check(args: argparse.Namespace, settings: None, parser: argparse.ArgumentParser) -> int:
    from relay.core.config_check import check_service  # noqa: PLC0415

    chosen = services() if args.service is None else {args.service: services()[args.service]}
    ok = True
    for name, cls in chosen.items():
        lines, valid = check_service(name, cls, os.environ, missing_is_error=args.service is not None)
        print("\n".join(lines))
        ok = ok and valid
    return 0 if ok else 1


def _cmd_config_reference(args: argparse.Namespace, settings: None, parser: argparse.ArgumentParser) -> int:
    from relay.core.settings import reference_table  # noqa: PLC0415

    print(reference_table(services()[args.service]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from relay.core.logging import configure_logging  # noqa: PLC0415

    handler: Handler | None = getattr(args, "handler", None)
    settings_class: type[Settings] | None = getattr(args, "settings_class", None)
    command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
    try:
        logging = load(LoggingSettings, args, os.environ)
        loaded = load(settings_class, args, os.environ) if settings_class is not None else None
    except SettingsError as exc:
        command_parser.error(str(exc))
    configure_logging(logging.settings.format, logging.settings.level)  # type: ignore[arg-type]
    import structlog  # noqa: PLC0415

    for warning in [*logging.warnings, *(loaded.warnings if loaded else [])]:
        structlog.get_logger("postbox").warning("setting_deprecated", message=warning)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args, loaded.settings if loaded else None, command_parser)


if __name__ == "__main__":
    sys.exit(main())
