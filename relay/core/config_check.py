"""`postbox config check`: what a daemon would start with, validated, with secrets masked; with --connect,
whether its database (and the schema's migrations) and its brokers answer with those settings.

The checks that reach a server (check_database, check_kafka) do I/O; the rest is pure."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from postbox.relay.core.settings import MissingSetting, Settings, SettingsError, declared, describe, load
from postbox.relay.core.tracing import DEFAULT_SERVICE_NAMES, TracingConfigError, plan_tracing

# A further check of a service whose settings are valid: (lines to show, problems), each problem one line.
Check = Callable[[Any], tuple[list[str], list[str]]]


def check_service(
    name: str,
    cls: type[Settings],
    environ: Mapping[str, str],
    *,
    missing_is_error: bool,
    more: Check | None = None,
) -> tuple[list[str], bool]:
    """Lines describing service `name`'s settings from `environ`, and whether they are valid.

    missing_is_error: when the service was asked for by name, a missing required setting makes it invalid;
    when every service is checked, that service is only "not configured" (a relay's environment need not
    configure the webhook receiver). A value that is given and wrong is invalid either way."""
    try:
        loaded = load(cls, None, environ)
    except MissingSetting as exc:
        if missing_is_error:
            return [f"{name}: INVALID: {exc}"], False
        return [f"{name}: not configured ({exc})"], True
    except SettingsError as exc:
        return [f"{name}: INVALID: {exc}"], False
    lines = [f"{name}: ok", *describe(loaded)]
    problems: list[str] = []
    lines.extend(f"  warning: {warning}" for warning in loaded.warnings)
    extra = getattr(loaded.settings, "effective_lines", None)
    if callable(extra):
        lines.extend(extra())
    if name in DEFAULT_SERVICE_NAMES:
        try:
            lines.extend(plan_tracing(name, environ).describe())
        except TracingConfigError as exc:
            lines[0] = f"{name}: INVALID: {exc}"
            return lines, False
    if more is not None:
        shown, problems = more(loaded.settings)
        lines.extend(shown)
    if problems:
        # Each problem on a line of its own; the first replaces "ok".
        lines[0] = f"{name}: PROBLEM: {problems[0]}"
        lines.extend(f"{name}: PROBLEM: {problem}" for problem in problems[1:])
    return lines, not problems


# -- variables no command reads (pure) ----------------------------------------------------------------


def known_variables(classes: Iterable[type[Settings]]) -> set[str]:
    """Every variable the settings `classes` declare: their own names, the _FILE form of secrets, the
    earlier names still read, and the retired ones (refused with a message of their own)."""
    known: set[str] = set()
    for cls in classes:
        for item in declared(cls):
            names = [item.env, *(old.env for old in item.declaration.renamed), *item.declaration.retired]
            for env in names:
                if "<" in env:
                    continue  # a family (POSTBOX_RDKAFKA_<NAME>): see families
                known.add(env)
                if item.declaration.secret:
                    known.add(f"{env}_FILE")
    return known


def unknown_variables(environ: Mapping[str, str], known: set[str], families: Iterable[str]) -> list[str]:
    """One line for each POSTBOX_* variable in `environ` that no command reads: a misspelling that would
    otherwise leave a setting silently at its default. families: prefixes whose every name is read
    (POSTBOX_RDKAFKA_ is any librdkafka property)."""
    prefixes = tuple(families)
    lines = []
    for name in sorted(environ):
        if not name.startswith("POSTBOX_") or name in known or name.startswith(prefixes):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"unknown variable {name}: no postbox command reads it{hint}")
    return lines


# -- reaching the servers (I/O) ------------------------------------------------------------------------


def check_database(dsn: str, schema: str | None) -> tuple[list[str], list[str]]:
    """Connect as a command would and compare the schema's migrations with this postbox's."""
    import psycopg  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.core.migrate import applied_version, load_migrations  # noqa: PLC0415
    from postbox.relay.core.operator_errors import SchemaState, explain, schema_verdict  # noqa: PLC0415
    from postbox.relay.core.redact import url_password  # noqa: PLC0415

    try:
        with connect(
            dsn, schema or "public", autocommit=True, application_name="postbox-config-check"
        ) as conn:
            applied = applied_version(conn, schema) if schema else None
    except psycopg.Error as exc:
        found = explain(exc, schema=schema, secrets=[url_password(dsn)])
        return [], [found.message if found is not None else f"database: {exc}".splitlines()[0]]
    if schema is None:
        return ["  database: reached (the schema is the app's: see the app's problem)"], []
    latest = load_migrations()[-1].version
    verdict = schema_verdict(SchemaState(schema, applied, latest))
    if verdict is not None:
        return [], [verdict.message]
    return [f'  database: reached; schema "{schema}" at migration {latest:04d} (current)'], []


def check_kafka(
    config: dict[str, Any], timeout: float, topics: Iterable[str] = ()
) -> tuple[list[str], list[str]]:
    """Ask the brokers for the cluster's metadata with the service's own librdkafka settings (so SASL and
    TLS are tried as the daemon would). `topics`: those the service reads, named when missing."""
    from confluent_kafka import KafkaError, KafkaException  # noqa: PLC0415
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415

    from postbox.relay.core.kafka_logs import message_shape  # noqa: PLC0415

    errors: list[str] = []

    def on_error(error: KafkaError) -> None:
        errors.append(error.str())

    # AdminClient is a producer-type client: keep only what it takes without a warning per property.
    # Quiet: the check's answer is its one line; librdkafka's lines would repeat it on stderr.
    quiet = logging.getLogger("postbox.kafka.config_check")
    quiet.disabled = True
    settings: dict[str, Any] = {**_admin_config(config), "error_cb": on_error, "logger": quiet}
    admin = AdminClient(settings)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        admin.poll(0)  # serves error_cb: librdkafka's own reason (refused, TLS, SASL) beats "timed out"
        failed = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
        # One of each kind: librdkafka repeats a refusal per attempt, with only its timings changed.
        distinct: dict[tuple[str, str], str] = {}
        for text in [*errors, failed]:
            distinct.setdefault(message_shape("", text), text)
        reason = "; ".join(distinct.values())
        bootstrap = config.get("bootstrap.servers", "")
        return [], [f"kafka unreachable at {bootstrap} (waited up to {timeout:g} s): {reason}"]
    lines = [f"  kafka: reached; brokers: {len(metadata.brokers)}, topics: {len(metadata.topics)}"]
    lines.extend(
        f"  kafka: topic {topic} does not exist yet" for topic in topics if topic not in metadata.topics
    )
    return lines, []


_CLIENT_ONLY = ("group.", "enable.auto.", "auto.", "isolation.level", "queued.", "fetch.", "session.")


def _admin_config(config: dict[str, Any]) -> dict[str, Any]:
    """A client configuration less the consumer's own properties (an AdminClient warns about each)."""
    return {k: v for k, v in config.items() if not k.startswith(_CLIENT_ONLY)}
