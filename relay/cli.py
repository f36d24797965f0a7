"""The `postbox` command. Subcommands import their heavy modules lazily so `postbox --help` stays quick."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence

from relay import __version__
from relay.core.cli_options import add_database_options, env_flag, require

Handler = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="postbox",
        description="Transactional-outbox relay and idempotent inbox for PostgreSQL and Apache Kafka.",
    )
    parser.add_argument("--version", action="version", version=f"postbox {__version__}")
    env_flag(
        parser,
        "--log-format",
        "POSTBOX_LOG_FORMAT",
        "log output: auto, json or console",
        default="auto",
        choices=["auto", "json", "console"],
    )
    env_flag(parser, "--log-level", "POSTBOX_LOG_LEVEL", "debug, info, warning or error", default="info")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    migrate = commands.add_parser("migrate", help="create or upgrade the postbox tables in a schema")
    add_database_options(migrate)
    migrate.set_defaults(handler=_cmd_migrate)

    dev = commands.add_parser("dev", help="a real local PostgreSQL and Kafka for trying postbox (no Docker)")
    dev_commands = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND", required=True)
    up = dev_commands.add_parser("up", help="start PostgreSQL and Kafka, apply the schema, wait for Ctrl-C")
    _add_stack_options(up)
    env_flag(
        up, "--name", "POSTBOX_DEV_STACK", "the stack's name, for `postbox dev env --name`", default="default"
    )
    up.set_defaults(handler=_cmd_dev_up)
    demo = dev_commands.add_parser("demo", help="the relay on the local stack with sample traffic to watch")
    env_flag(
        demo,
        "--duration",
        "POSTBOX_DEMO_DURATION",
        "seconds to run (0: until Ctrl-C)",
        type=float,
        default=30.0,
    )
    env_flag(demo, "--rate", "POSTBOX_DEMO_RATE", "orders written per second", type=float, default=5.0)
    demo.set_defaults(handler=_cmd_dev_demo)
    env = dev_commands.add_parser("env", help="print the connection settings of a running local stack")
    env_flag(
        env,
        "--name",
        "POSTBOX_DEV_STACK",
        "which stack (as named by `postbox dev up --name`)",
        default="default",
    )
    env.set_defaults(handler=_cmd_dev_env)

    config = commands.add_parser("config", help="check the configuration")
    config_commands = config.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND", required=True)
    check = config_commands.add_parser(
        "check",
        help="validate the POSTBOX_* settings and print them, secrets masked (exit 1 when one is invalid)",
    )
    check.set_defaults(handler=_cmd_config_check)

    from relay.outbox.cli import add_relay_commands  # noqa: PLC0415

    add_relay_commands(commands)
    from inbox.cli import add_inbox_commands  # noqa: PLC0415

    add_inbox_commands(commands)
    return parser


def _add_stack_options(parser: argparse.ArgumentParser) -> None:
    env_flag(
        parser,
        "--postgres",
        "POSTBOX_DEV_POSTGRES",
        "which PostgreSQL binaries: auto, embedded, system",
        default="auto",
        choices=["auto", "embedded", "system"],
    )
    env_flag(
        parser,
        "--kafka-nodes",
        "POSTBOX_DEV_KAFKA_NODES",
        "Kafka nodes (1, or 3 for a quorum)",
        default=1,
        type=int,
    )
    env_flag(parser, "--schema", "POSTBOX_SCHEMA", "schema for the postbox tables", default="postbox")


def _cmd_migrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    require(args, parser, "database_url")
    import psycopg  # noqa: PLC0415

    from relay.core.migrate import migrate  # noqa: PLC0415

    with psycopg.connect(args.database_url) as conn:
        applied = migrate(conn, args.schema)
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none (already up to date)"
    print(f"schema {args.schema}: applied {names}")
    return 0


def _cmd_dev_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import signal  # noqa: PLC0415

    import psycopg  # noqa: PLC0415

    from relay.core.migrate import migrate  # noqa: PLC0415
    from relay.devstack.stack import check_stack_name, local_stack, read_state  # noqa: PLC0415

    try:
        check_stack_name(args.name)
    except ValueError as exc:
        parser.error(f"--name: {exc}")
    if read_state(args.name) is not None:
        parser.error(f"a stack named {args.name!r} is already running; give this one another --name")
    print("starting PostgreSQL and Kafka (the first start fetches the Kafka jars with Maven)...", flush=True)
    stack = local_stack(pg=args.postgres, kafka_nodes=args.kafka_nodes, publish_state=True, name=args.name)
    with stack as (_, _, info):
        with psycopg.connect(info.database_url) as conn:
            migrate(conn, args.schema)
        print(f"PostgreSQL {info.postgres_version}  {info.database_url}")
        print(f"Kafka {info.kafka_version}      {info.kafka_bootstrap}")
        env_command = "postbox dev env" + ("" if args.name == "default" else f" --name {args.name}")
        print(f'schema {args.schema} is migrated. In another terminal:  eval "$({env_command})"')
        print("Ctrl-C stops both servers and deletes their data.", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


def _cmd_dev_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from relay.devstack.demo import run_demo  # noqa: PLC0415

    return run_demo(args.duration, args.rate)


def _cmd_dev_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from relay.devstack.stack import check_stack_name, read_state, running_stacks  # noqa: PLC0415

    try:
        info = read_state(check_stack_name(args.name))
    except ValueError as exc:
        parser.error(f"--name: {exc}")
    if info is None:
        others = running_stacks()
        hint = (
            f"; running: {', '.join(others)} (use --name)" if others else " (start one with `postbox dev up`)"
        )
        print(f"postbox: no local stack named {args.name!r} is running{hint}", file=sys.stderr)
        return 1
    print(
        f"# postbox dev stack {args.name!r}: PostgreSQL {info.postgres_version}, Kafka {info.kafka_version}"
    )
    for name, value in info.as_env().items():
        print(f"export {name}={value}")
    return 0


def _cmd_config_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os  # noqa: PLC0415

    from relay.core.config_check import environment_lines, run_checks  # noqa: PLC0415

    def relay_settings() -> dict[str, object] | None:
        if "POSTBOX_KAFKA_BOOTSTRAP" not in os.environ:
            return None
        from relay.outbox.cli import settings_from_args  # noqa: PLC0415

        settings = settings_from_args(build_parser().parse_args(["relay", "run"]))
        return {
            "database_url": settings.database_url,
            "schema": settings.schema,
            "batch_size": settings.batch_size,
            "lease_ttl": settings.lease_ttl,
            **{f"rdkafka {k}": v for k, v in settings.producer_config().items()},
        }

    def webhook_providers() -> dict[str, object] | None:
        from inbox.webhooks.config import providers_from_env  # noqa: PLC0415

        try:
            providers = providers_from_env()
        except ValueError as exc:
            if "no webhook provider is configured" in str(exc):
                return None
            raise
        return {name: type(provider).__name__ for name, provider in providers.items()}

    print("environment:")
    print("\n".join(environment_lines()) or "  (no POSTBOX_* variables)")
    lines, ok = run_checks({"relay": relay_settings, "webhook receiver": webhook_providers})
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from relay.core.logging import configure_logging  # noqa: PLC0415

    try:
        configure_logging(args.log_format, args.log_level)
    except ValueError as exc:
        parser.error(str(exc))
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args, parser)


if __name__ == "__main__":
    sys.exit(main())
