"""Settings declared once. Each field of a settings dataclass carries its declaration (help, bounds, secret or
not, its variable); the CLI flag, the environment variable, validation with a message naming the setting,
`--help`, `postbox config check` and the tables of docs/reference/settings.md all come from it. Pure apart
from reading the files `*_FILE` variables name.

A service's variables share its prefix (POSTBOX_RELAY_, POSTBOX_INBOX_, POSTBOX_WEBHOOK_); the connection
settings, logging and the metrics address are shared and keep plain POSTBOX_ names. Nothing is read from the
environment while the parser is built: a command reads only the settings it declares, after parsing, so
a bad variable of another service cannot break it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Generic, TypeVar

from postbox.relay.core.db import DEFAULT_SCHEMA, check_database_url
from postbox.relay.core.kafka_config import kafka_config_from
from postbox.relay.core.redact import MASK, redact
from postbox.relay.core.secrets import comma_list
from postbox.relay.core.secrets import secret as read_secret
from postbox.relay.core.sql import check_schema_name

_KEY = "postbox.setting"
NO_DEFAULT = "\N{EN DASH}"  # how --help and the settings reference show "no default"


class SettingsError(ValueError):
    """A setting is invalid; the message starts with the setting's flag and variable."""


class MissingSetting(SettingsError):
    """A required setting is not given (`config check` without --service calls that "not configured")."""


@dataclass(frozen=True)
class Renamed:
    """An earlier name of a setting, read for one more release with a deprecation warning."""

    env: str
    negated: bool = False  # the old name said the opposite (POSTBOX_NO_LISTEN for listen)


# Earlier names that several services read with different meanings. Guessing which one was meant could
# turn a relay batch of 1,000 into a webhook claim of 1,000, so they are refused with the names to use.
AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "POSTBOX_BATCH_SIZE": (
        "POSTBOX_RELAY_BATCH_SIZE",
        "POSTBOX_INBOX_BATCH_SIZE",
        "POSTBOX_WEBHOOK_BATCH_SIZE",
    ),
}


@dataclass(frozen=True)
class Declaration:
    help: str
    parse: Callable[[str], Any]
    env: str | None = None  # None: the service's prefix plus the field's name in capitals
    flag: str | None = None  # None: --field-name
    secret: bool = False  # also read from ${env}_FILE; never shown
    switch: bool = False  # --x / --no-x; the variable takes true/false
    required: bool = False
    choices: tuple[str, ...] = ()
    bounds: tuple[float, float] | None = None  # inclusive; seconds for durations
    shown_default: str | None = None  # what --help and the docs say when the default is computed
    renamed: tuple[Renamed, ...] = ()
    retired: tuple[str, ...] = ()  # earlier names now refused (see AMBIGUOUS)
    # For settings gathered from a family of variables plus a repeatable flag (librdkafka's properties):
    # called with the flag's values and the environment instead of `parse`.
    gather: Callable[[list[str], Mapping[str, str]], Any] | None = None
    metavar: str | None = None
    # A check of a given (non-empty) value that raises ValueError, run however the settings are built.
    validate: Callable[[Any], None] | None = None


# -- value parsers: each raises ValueError with a message that reads after "<setting>: 'value' ..."


def integer(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError("is not a whole number") from None


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return value


def text(value: str) -> str:
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("is not a boolean (use true or false)")


def duration(text: str) -> timedelta:
    """'90s', '15m', '36h', '7d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        scale = units.get(text[-1:], 0)
        return timedelta(seconds=float(text[:-1]) * scale if scale else float(text))
    except (ValueError, OverflowError):  # OverflowError: 1e20 or inf (found by the fuzzer)
        raise ValueError("is not a duration like 90s, 15m, 36h or 7d") from None


def secret_list(text: str) -> tuple[str, ...]:
    """Several secrets (rotation), comma- or newline-separated; at least one."""
    found = comma_list(text)
    if not found:
        raise ValueError("holds no secret")
    return found


_PARSERS: dict[type, Callable[[str], Any]] = {
    bool: boolean,
    int: integer,
    float: number,
    str: text,
    timedelta: duration,
}


def setting(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, **options: Any) -> Any:
    """A settings-dataclass field and its declaration. The parser follows the default's type unless given;
    a bool default makes a switch."""
    factory = options.pop("factory", None)
    if parse is None and options.get("gather") is None:
        kind = type(default)
        if kind not in _PARSERS:
            raise TypeError(f"give parse= for a setting whose default is {default!r}")
        parse = _PARSERS[kind]
    declaration = Declaration(help=help, parse=parse or text, switch=isinstance(default, bool), **options)
    if factory is not None:
        return field(default_factory=factory, metadata={_KEY: declaration})
    return field(default=default, metadata={_KEY: declaration})


# -- the settings every service shares: one declaration each


def shared_database_url() -> Any:
    return setting(
        "",
        "PostgreSQL connection URL (libpq syntax, so TLS options such as sslmode go here)",
        env="POSTBOX_DATABASE_URL",
        secret=True,
        required=True,
        validate=check_database_url,
    )


def shared_schema(default: str | None = DEFAULT_SCHEMA) -> Any:
    shown = None if default else "the app's"
    return setting(
        default,
        "schema holding the postbox tables",
        parse=check_schema_name,  # refused at start, naming the setting: '$user', empty, NUL, pg_*
        env="POSTBOX_SCHEMA",
        shown_default=shown,
    )


def shared_kafka_bootstrap() -> Any:
    return setting(
        "", "Kafka bootstrap servers (host:port,...)", env="POSTBOX_KAFKA_BOOTSTRAP", required=True
    )


def shared_kafka_config() -> Any:
    return setting(
        None,
        "librdkafka property, repeatable (SASL, TLS, linger...); POSTBOX_RDKAFKA_SECURITY_PROTOCOL=SASL_SSL "
        "sets security.protocol",
        env="POSTBOX_RDKAFKA_<NAME>",
        gather=_gather_kafka_config,
        factory=dict,
        metavar="KEY=VALUE",
    )


def _gather_kafka_config(flags: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    return kafka_config_from(flags, dict(environ))


def shared_metrics_address(default: str | None) -> Any:
    return setting(
        default,
        "host:port for /metrics, /healthz, /readyz" + ("" if default else " (off when unset)"),
        parse=host_port,
        env="POSTBOX_METRICS_ADDRESS",
    )


def host_port(value: str) -> str:
    _, colon, port = value.rpartition(":")
    if not colon or not port.isascii() or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("is not host:port")
    return value


S = TypeVar("S", bound="Settings")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of every settings class: the declared checks (required, bounds, choices) run on construction,
    however the object is built; `check` adds a class's rules between settings."""

    PREFIX: ClassVar[str] = "POSTBOX_"
    SERVICE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        items = list(declared(type(self)))
        for item in items:
            value = getattr(self, item.name)
            if value is None or item.declaration.gather is not None:
                continue
            if item.declaration.validate is not None and value != "":
                try:
                    item.declaration.validate(value)
                except ValueError as exc:
                    raise SettingsError(f"{item.label}: {exc}") from None
            if item.declaration.choices and value not in item.declaration.choices:
                raise SettingsError(
                    f"{item.label}: {value!r} is not one of {', '.join(item.declaration.choices)}"
                )
            if item.declaration.bounds is not None:
                low, high = item.declaration.bounds
                measure = value.total_seconds() if isinstance(value, timedelta) else value
                if not low <= measure <= high:  # also refuses NaN
                    raise SettingsError(
                        f"{item.label}: {_show(value)} is outside {_show(low)}..{_show(high)}"
                    )
        # After the value checks, so a wrong value is reported even when a required setting is missing too.
        for item in items:
            if item.declaration.required and not getattr(self, item.name):
                raise MissingSetting(f"{item.label}: required")
        self.check()

    def check(self) -> None:
        """Rules between settings; raise SettingsError starting with `self.label(name)`."""

    @classmethod
    def label(cls, name: str) -> str:
        for item in declared(cls):
            if item.name == name:
                return item.label
        raise KeyError(name)


def _show(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Declared:
    name: str
    declaration: Declaration
    env: str
    flag: str
    default: Any

    @property
    def label(self) -> str:
        return f"{self.flag} ({self.env})"

    @property
    def shown_default(self) -> str:
        """The default as --help and the settings reference state it."""
        if self.declaration.shown_default is not None:
            return self.declaration.shown_default
        if self.declaration.secret or self.default in (None, "", {}, (), []):
            return NO_DEFAULT
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, timedelta):
            return _duration_text(self.default)
        return _show(self.default)


def _duration_text(value: timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{_show(seconds)}s"


def declared(cls: type[Settings]) -> Iterator[Declared]:
    """Every declared setting of `cls`, in declaration order."""
    for item in dataclasses.fields(cls):
        declaration = item.metadata.get(_KEY)
        if declaration is None:
            continue
        env = declaration.env or cls.PREFIX + item.name.upper()
        flag = declaration.flag or "--" + item.name.replace("_", "-")
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        yield Declared(item.name, declaration, env, flag, default)


def add_flags(parser: argparse.ArgumentParser, cls: type[Settings], *, command: bool = True) -> None:
    """One flag per declared setting. Nothing is read here: defaults are applied by `load`, after parsing,
    so --help shows the declared default and a bad variable breaks only the command that reads it.
    command: `cls` is what this (sub)command runs with, loaded for it by `postbox`'s main()."""
    for item in declared(cls):
        declaration = item.declaration
        env = f"{item.env} or {item.env}_FILE" if declaration.secret else item.env
        shown = item.shown_default
        help = f"{declaration.help} (env {env}" + (f", default {shown})" if shown != NO_DEFAULT else ")")
        options: dict[str, Any] = {"dest": item.name, "default": None, "help": help.replace("%", "%%")}
        if declaration.switch:
            options["action"] = argparse.BooleanOptionalAction
        elif declaration.gather is not None:
            options["action"] = "append"
        if declaration.choices:
            options["choices"] = declaration.choices
        if declaration.metavar:
            options["metavar"] = declaration.metavar
        parser.add_argument(item.flag, **options)
    if command:
        parser.set_defaults(settings_class=cls, command_parser=parser)


@dataclass(frozen=True)
class Loaded(Generic[S]):
    settings: S
    sources: dict[str, str]  # setting name -> "flag", "env NAME", "deprecated NAME" or "default"
    warnings: list[str]


def load(cls: type[S], args: argparse.Namespace | None, environ: Mapping[str, str]) -> Loaded[S]:
    """The settings `cls` declares: each from its flag, else its variable, else an earlier name of it
    (with a warning), else its default. SettingsError names the setting."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []
    for item in declared(cls):
        given = getattr(args, item.name, None) if args is not None else None
        if item.declaration.gather is not None:
            try:
                values[item.name] = item.declaration.gather(list(given or []), environ)
            except ValueError as exc:
                raise SettingsError(f"{item.label}: {exc}") from None
            sources[item.name] = "flag and env" if given else "env"
            continue
        if given is not None:
            values[item.name], sources[item.name] = _convert(item, given), "flag"
            continue
        found = _from_environment(item, environ)
        if found is None:
            sources[item.name] = "default"
            continue
        raw, source, negate = found
        value = _convert(item, raw)
        values[item.name] = (not value) if negate else value
        sources[item.name] = source
        if source.startswith("deprecated "):
            warnings.append(f"{source.split()[1]} is deprecated and will be removed: set {item.env}")
    try:
        settings = cls(**values)
    except SettingsError:
        raise
    except ValueError as exc:  # a class's own check that does not know the flag names
        raise SettingsError(str(exc)) from None
    return Loaded(settings, sources, warnings)


def _from_environment(item: Declared, environ: Mapping[str, str]) -> tuple[str, str, bool] | None:
    """(raw value, where from, negated) from the setting's variable or an earlier name of it."""
    for retired in item.declaration.retired:
        if retired in environ or f"{retired}_FILE" in environ:
            names = " or ".join(AMBIGUOUS.get(retired, (item.env,)))
            raise SettingsError(
                f"{retired} is no longer read: services took it with different meanings. "
                f"Set {names} (this command reads {item.env})"
            )
    raw = _read(item.env, item.declaration, environ)
    if raw is not None:
        return raw, f"env {_variable(item.env, environ)}", False
    for old in item.declaration.renamed:
        raw = _read(old.env, item.declaration, environ)
        if raw is not None:
            return raw, f"deprecated {_variable(old.env, environ)}", old.negated
    return None


def _variable(env: str, environ: Mapping[str, str]) -> str:
    """The variable a value came from: NAME, or NAME_FILE for a secret read from a file."""
    return env if env in environ else f"{env}_FILE"


def _read(env: str, declaration: Declaration, environ: Mapping[str, str]) -> str | None:
    if declaration.secret:
        try:
            return read_secret(env, dict(environ))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    return environ.get(env)


def _convert(item: Declared, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw  # a switch given as a flag is already a bool
    try:
        return item.declaration.parse(raw)
    except (ValueError, TypeError) as exc:
        shown = MASK if item.declaration.secret else repr(raw[:80])
        raise SettingsError(f"{item.label}: {shown} {exc}") from None


def describe(loaded: Loaded[Settings]) -> list[str]:
    """One line per declared setting: variable, value (secrets masked), where it came from."""
    lines = []
    for item in declared(type(loaded.settings)):
        value = getattr(loaded.settings, item.name)
        if item.declaration.gather is not None and isinstance(value, dict):
            source = loaded.sources.get(item.name, "given")
            for key, property_value in sorted(value.items()):
                shown = redact(key, str(property_value))
                variable = item.env.replace("<NAME>", key.upper().replace(".", "_"))
                lines.append(f"  {variable} = {shown}  ({source}: {key})")
            continue
        if value is None and item.declaration.shown_default is not None:
            shown = item.declaration.shown_default  # a default worked out later (by the mode, say)
        elif value in (None, "", ()):
            shown = "(unset)"
        elif item.declaration.secret:
            shown = redact(item.env, str(value)) if "://" in str(value) else MASK
        elif isinstance(value, timedelta):
            shown = _duration_text(value)
        elif isinstance(value, bool):
            shown = "true" if value else "false"  # as the variable takes it
        else:
            written = ",".join(value) if isinstance(value, tuple | list) else _show(value)
            shown = redact(item.env, written)
        lines.append(f"  {item.env} = {shown}  ({loaded.sources.get(item.name, 'given')})")
    return lines


def reference_table(cls: type[Settings]) -> str:
    """The table of `cls`'s settings in docs/reference/settings.md (a test keeps the page equal to this)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for item in declared(cls):
        flag = f"`{item.flag}`" if not item.declaration.switch else f"`{item.flag}` / `--no-{item.flag[2:]}`"
        env = f"`{item.env}`" + (" (or `_FILE`)" if item.declaration.secret else "")
        shown = item.shown_default
        default = shown if shown in (NO_DEFAULT, "on", "off") or " " in shown else f"`{shown}`"
        rows.append(f"| {flag} | {env} | {default} | {item.declaration.help.replace('|', '/')} |")
    return "\n".join(rows)


@dataclass(frozen=True, kw_only=True)
class DatabaseSettings(Settings):
    """What every command that only talks to the database takes."""

    database_url: str = shared_database_url()
    schema: str = shared_schema()
