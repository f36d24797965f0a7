"""The `postbox` command. Subcommands import their heavy modules lazily so `postbox --help` stays quick.

Each command declares its settings as a dataclass (relay.core.settings); main() loads that command's
settings, and only those, after parsing, and hands them to the command."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from postbox.relay import __version__
from postbox.relay.core.logging import LoggingSettings
from postbox.relay.core.settings import Settings, SettingsError, add_flags, load
from postbox.relay.devstack.settings import DemoSettings, StackChoice, StackSettings

if TYPE_CHECKING:
    from postbox.relay.core.operator_errors import OperatorError
    from postbox.relay.outbox.settings import MigrateSettings

Handler = Callable[[argparse.Namespace, Any, argparse.ArgumentParser], int]


def services() -> dict[str, type[Settings]]:
    """The daemons `postbox config check --service` and the settings reference's tables
    (docs/reference/settings.md) describe."""
    from postbox.inbox.settings import ConsumeSettings, ServeSettings, WorkSettings  # noqa: PLC0415
    from postbox.relay.outbox.settings import RelaySettings  # noqa: PLC0415

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

    from postbox.relay.outbox.settings import MigrateSettings  # noqa: PLC0415

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
    check.add_argument(
        "--service",
        choices=["relay", "inbox", "webhook-worker", "receiver"],
        help="check this service only, and fail when its required settings are absent",
    )
    check.add_argument(
        "--connect",
        action="store_true",
        help="also reach each configured service's database (and check its schema's migrations) and "
        "brokers, with its own settings and credentials",
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --connect: how long the brokers may take to answer (default 10)",
    )
    check.set_defaults(handler=_cmd_config_check)
    reference = config_commands.add_parser(
        "reference",
        help="a service's settings, or every command, as Markdown (the tables of docs/reference/settings.md "
        "and the page docs/reference/cli.md are these)",
    )
    what = reference.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--service",
        choices=["relay", "inbox", "webhook-worker", "receiver"],
        help="this service's settings: flag, variable, default and meaning of each",
    )
    what.add_argument(
        "--commands", action="store_true", help="every postbox command with its arguments and options"
    )
    reference.set_defaults(handler=_cmd_config_reference)

    from postbox.relay.outbox.cli import add_relay_commands  # noqa: PLC0415

    add_relay_commands(commands)
    from postbox.relay.capture.cli import add_capture_commands  # noqa: PLC0415

    add_capture_commands(commands)
    from postbox.inbox.cli import add_inbox_commands  # noqa: PLC0415

    add_inbox_commands(commands)
    return parser


def _cmd_migrate(args: argparse.Namespace, settings: MigrateSettings, parser: argparse.ArgumentParser) -> int:
    import psycopg  # noqa: PLC0415

    from postbox.relay.core.migrate import created_by  # noqa: PLC0415
    from postbox.relay.outbox.admin import migrate_schema  # noqa: PLC0415

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

    from postbox.relay.devstack.stack import local_stack, read_state  # noqa: PLC0415
    from postbox.relay.outbox.admin import migrate_schema  # noqa: PLC0415

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
    from postbox.relay.devstack.demo import run_demo  # noqa: PLC0415

    return run_demo(settings.duration, settings.rate)


def _cmd_dev_env(args: argparse.Namespace, settings: StackChoice, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.devstack.stack import read_state, running_stacks  # noqa: PLC0415

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
    from postbox.relay.core.config_check import check_service, known_variables, unknown_variables  # noqa: PLC0415

    chosen = services() if args.service is None else {args.service: services()[args.service]}
    ok = True
    for name, cls in chosen.items():
        lines, valid = check_service(
            name,
            cls,
            os.environ,
            missing_is_error=args.service is not None,
            more=functools.partial(_further_checks, name, connect=args.connect, timeout=args.timeout),
        )
        print("\n".join(lines))
        ok = ok and valid
    families = (*_VARIABLE_FAMILIES, *_generic_provider_families(os.environ))
    unknown = unknown_variables(os.environ, known_variables(_every_settings_class()), families)
    if unknown:
        print("\n".join(unknown))
    return 0 if ok and not unknown else 1


# Variables read outside the settings' declarations: families of names, and the tools' own.
_VARIABLE_FAMILIES = (
    "POSTBOX_RDKAFKA_",  # any librdkafka property (relay.core.kafka_config)
    "POSTBOX_TEST_",  # the test suite's servers (tests/support/servers.py)
    "POSTBOX_PG_BIN",  # the dev stack's PostgreSQL binaries (relay.devstack.postgres)
    "POSTBOX_CACHE_DIR",  # the dev stack's Kafka jars (relay.devstack.kafka)
    "POSTBOX_TRACE_WATERFALL",  # the tracing test's picture (tests/integration/test_tracing.py)
)


def _generic_provider_families(environ: Mapping[str, str]) -> list[str]:
    """POSTBOX_WEBHOOK_<NAME>_ for each generic HMAC provider POSTBOX_WEBHOOK_GENERIC names (their
    variables are read by inbox.webhooks.config.providers_from, under the same prefix)."""
    from postbox.relay.core.secrets import comma_list  # noqa: PLC0415

    names = comma_list(environ.get("POSTBOX_WEBHOOK_GENERIC", ""))
    return [f"POSTBOX_WEBHOOK_{name.upper().replace('-', '_')}_" for name in names]


def _every_settings_class() -> list[type[Settings]]:
    """The settings every `postbox` command reads, found on the parser (so a new command is included)."""
    found: list[type[Settings]] = [LoggingSettings]
    pending = [build_parser()]
    while pending:
        parser = pending.pop()
        cls = parser.get_default("settings_class")
        if cls is not None and cls not in found:
            found.append(cls)
        for action in parser._actions:  # argparse keeps its subparsers only here
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return found


def _further_checks(name: str, loaded: Any, *, connect: bool, timeout: float) -> tuple[list[str], list[str]]:
    """For a service whose settings are valid: its app loads (no server needed); with --connect, its
    database and schema, and its brokers, answer."""
    lines: list[str] = []
    problems: list[str] = []
    schema = getattr(loaded, "schema", None)
    if name in ("inbox", "webhook-worker"):
        app, problem = _check_app(name, loaded)
        if problem is not None:
            problems.append(problem)
        else:
            schema = schema or app.schema
            lines.append(f"  app: {loaded.app} loaded ({type(app).__name__}, schema {app.schema})")
    if not connect:
        return lines, problems
    from postbox.relay.core.config_check import check_database  # noqa: PLC0415

    for shown, found in (
        check_database(loaded.database_url, schema),
        *(_kafka_check(name, loaded, timeout) if getattr(loaded, "kafka_bootstrap", None) else []),
    ):
        lines.extend(shown)
        problems.extend(found)
    return lines, problems


def _kafka_check(name: str, loaded: Any, timeout: float) -> list[tuple[list[str], list[str]]]:
    from postbox.relay.core.config_check import check_kafka  # noqa: PLC0415

    if name == "relay":
        config = loaded.producer_config()  # exactly what the relay's producer gets
    else:
        config = {"bootstrap.servers": loaded.kafka_bootstrap, **loaded.kafka_config}
    return [check_kafka(config, timeout, getattr(loaded, "topics", None) or ())]


def _check_app(name: str, loaded: Any) -> tuple[Any, str | None]:
    """The service's --app object, or why it cannot be had: importing it runs the app's module, as the
    daemon's start would."""
    if name == "inbox":
        from postbox.inbox.handlers import Inbox as kind  # noqa: PLC0415
    else:
        from postbox.inbox.webhooks.worker import Webhooks as kind  # type: ignore[assignment]  # noqa: PLC0415
    from postbox.inbox.cli import load_app  # noqa: PLC0415

    label = type(loaded).label("app")
    try:
        return load_app(loaded.app, kind), None
    except ImportError as exc:
        return None, f"{label}: {loaded.app!r}: cannot import {exc.name or loaded.app}: {exc}"
    except ValueError as exc:  # load_app's own words start with "--app 'spec'"
        return None, f"{label}: {str(exc).removeprefix('--app ')}"
    except Exception as exc:  # noqa: BLE001  (the app's module raised while importing: say so, not crash)
        return None, f"{label}: {loaded.app!r}: importing it raised {type(exc).__name__}: {exc}"


def _cmd_config_reference(args: argparse.Namespace, settings: None, parser: argparse.ArgumentParser) -> int:
    from postbox.relay.core.settings import reference_table  # noqa: PLC0415

    print(commands_reference() if args.commands else reference_table(services()[args.service]))
    return 0


# The width the command reference's usage lines are wrapped at, whatever the terminal's.
REFERENCE_WIDTH = 100


def commands_reference() -> str:
    """Every `postbox` command as Markdown, walked from the parser: what it does, its usage, its arguments
    and options with their help (which names each setting's variable and default). docs/reference/cli.md
    holds this text, and a test keeps it equal."""
    sections: list[str] = []
    pending: list[tuple[argparse.ArgumentParser, str]] = [(build_parser(), "")]
    while pending:
        parser, summary = pending.pop(0)
        formatter = argparse.HelpFormatter(parser.prog, width=REFERENCE_WIDTH)
        formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
        lines = [f"## {parser.prog}", ""]
        if summary or parser.description:
            lines += [_cell(summary or parser.description or ""), ""]
        lines += ["```text", formatter.format_help().strip(), "```"]
        children: list[tuple[argparse.ArgumentParser, str]] = []
        arguments: list[tuple[str, str]] = []
        options: list[tuple[str, str]] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
                children += [(sub, helps.get(name, "")) for name, sub in action.choices.items()]
            elif isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            else:
                meaning = formatter._expand_help(action) if action.help else ""
                row = (formatter._format_action_invocation(action), meaning)
                (options if action.option_strings else arguments).append(row)
        if children:
            lines += ["", "| command | what it does |", "|---|---|"]
            lines += [f"| [`{sub.prog}`](#{_anchor(sub.prog)}) | {_cell(text)} |" for sub, text in children]
        for title, rows in (("argument", arguments), ("option", options)):
            if rows:
                lines += ["", f"| {title} | meaning |", "|---|---|"]
                lines += [f"| `{invocation}` | {_cell(text)} |" for invocation, text in rows]
        sections.append("\n".join(lines))
        pending = children + pending  # depth first: a command's own commands follow it
    return "\n\n".join(sections)


def _anchor(prog: str) -> str:
    """The id Markdown gives the heading `## prog` (mkdocs' default slugs: lower case, words joined by -)."""
    return "-".join(prog.lower().split())


def _cell(text: str) -> str:
    """`text` on one line, safe in a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from postbox.relay.core.logging import configure_logging  # noqa: PLC0415

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
    settings = loaded.settings if loaded else None
    try:
        return handler(args, settings, command_parser)
    except Exception as exc:
        problem = _operator_error(exc, settings)
        if problem is None:
            raise  # not an operator's mistake: a bug keeps its traceback
        if getattr(settings, "SERVICE", "") or getattr(settings, "every", None) is not None:
            # A daemon's output is its log stream (JSON in production): the reason it stopped is an event.
            structlog.get_logger("postbox").error(
                "postbox_stopped", error=problem.message, exit_code=problem.exit_code
            )
        else:
            print(f"postbox: {problem.message}", file=sys.stderr)
        return problem.exit_code


def _operator_error(exc: Exception, settings: object) -> OperatorError | None:
    """`exc` as one line and an exit code when it is an ordinary mistake (relay.core.operator_errors).
    After an error about a missing table, column or function it looks at the schema's migrations, so the
    line says whether the schema was never migrated, is behind, or (current: a bug) not an operator error."""
    from postbox.relay.core.migrate import schema_state  # noqa: PLC0415
    from postbox.relay.core.operator_errors import SCHEMA_IN_USE, explain, needs_schema_state  # noqa: PLC0415

    dsn = getattr(settings, "database_url", None)
    schema = getattr(settings, "schema", None) or SCHEMA_IN_USE.get()
    state = schema_state(dsn, schema) if dsn and schema and needs_schema_state(exc) else None
    return explain(exc, schema=schema, state=state, secrets=_passwords(dsn))


def _passwords(dsn: str | None) -> list[str | None]:
    """The password a connection URL carries, however it is written (user:pw@ or ?password=)."""
    if not dsn:
        return []
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    from postbox.relay.core.redact import url_password  # noqa: PLC0415

    try:
        keyword = conninfo_to_dict(dsn).get("password")
    except Exception:  # noqa: BLE001  (settings checked the URL; this is only belt and braces)
        keyword = None
    return [url_password(dsn), str(keyword) if keyword else None]


if __name__ == "__main__":
    sys.exit(main())
