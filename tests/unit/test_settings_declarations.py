"""Every declared setting, walked: its flag, variable, default and help agree, wherever it is used."""

import argparse
from collections.abc import Iterator
from datetime import timedelta

import pytest

from postbox.relay.cli import build_parser
from postbox.relay.core.settings import NO_DEFAULT, Settings, SettingsError, declared, load

SHARED = {
    "POSTBOX_DATABASE_URL",
    "POSTBOX_SCHEMA",
    "POSTBOX_KAFKA_BOOTSTRAP",
    "POSTBOX_RDKAFKA_<NAME>",
    "POSTBOX_METRICS_ADDRESS",
}


def commands(
    parser: argparse.ArgumentParser, path: str = "postbox"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def with_settings() -> list[tuple[str, argparse.ArgumentParser, type[Settings]]]:
    found = []
    for path, parser in commands(build_parser()):
        cls = parser.get_default("settings_class")
        if cls is not None:
            found.append((path, parser, cls))
    return found


def test_every_command_that_takes_settings_declares_them() -> None:
    paths = {path for path, _, _ in with_settings()}
    for expected in (
        "postbox relay run",
        "postbox inbox consume",
        "postbox inbox serve",
        "postbox inbox work",
        "postbox migrate",
        "postbox inbox reconcile",
        "postbox dev up",
    ):
        assert expected in paths


@pytest.mark.parametrize(
    ("path", "parser", "cls"), with_settings(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_flag_variable_default_and_help_agree(
    path: str, parser: argparse.ArgumentParser, cls: type[Settings]
) -> None:
    actions = {option: action for action in parser._actions for option in action.option_strings}
    for item in declared(cls):
        action = actions.get(item.flag)
        assert action is not None, f"{path}: {item.flag} is declared but not a flag"
        assert action.dest == item.name, f"{path} {item.flag}"
        assert action.default is None, (
            f"{path} {item.flag}: defaults are applied after parsing, not by argparse"
        )
        assert f"(env {item.env}" in (action.help or ""), f"{path} {item.flag}: help does not name {item.env}"
        if item.shown_default != NO_DEFAULT:
            assert f"default {item.shown_default})" in (action.help or ""), f"{path} {item.flag}"
        assert item.env in SHARED or item.env.startswith(cls.PREFIX), (
            f"{path}: {item.env} outside {cls.PREFIX}"
        )
        assert item.declaration.help, f"{path} {item.flag}"
        assert not item.declaration.help.endswith("."), f"{path} {item.flag}: help is a phrase, as argparse's"
        # The default, written as a user would write it, parses back to itself.
        default = item.default
        parsable = isinstance(default, (int, float, str, timedelta)) and not isinstance(default, bool)
        if item.declaration.gather is None and parsable and default != "":
            written = f"{default.total_seconds()}s" if isinstance(default, timedelta) else str(default)
            assert item.declaration.parse(written) == default, f"{path} {item.flag}"


def test_a_variable_means_one_thing_wherever_it_is_read() -> None:
    meaning: dict[str, object] = {}
    for path, _, cls in with_settings():
        for item in declared(cls):
            for name in (item.env, *(old.env for old in item.declaration.renamed)):
                parse = item.declaration.gather or item.declaration.parse
                assert meaning.setdefault(name, parse) is parse, (
                    f"{path}: {name} is read with another meaning"
                )


def minimal_environment(cls: type[Settings], database_url: str) -> dict[str, str]:
    """Only what `cls` requires (each command's own required settings), with this database URL."""
    required = {item.env: "x:1" for item in declared(cls) if item.declaration.required}
    return {
        **required,
        "POSTBOX_DATABASE_URL": database_url,
        "POSTBOX_INBOX_TOPICS": "t",
        "POSTBOX_INBOX_APP": "m:a",
        "POSTBOX_WEBHOOK_APP": "m:a",
        "POSTBOX_WEBHOOK_RECONCILER": "m:a",
        "POSTBOX_WEBHOOK_STRIPE_SECRETS": "whsec_x",
    }


@pytest.mark.parametrize(
    ("path", "parser", "cls"), with_settings(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_the_declared_defaults_are_valid(
    path: str, parser: argparse.ArgumentParser, cls: type[Settings]
) -> None:
    """With only the required settings given, each command's settings build: no default breaks a bound."""
    load(cls, None, minimal_environment(cls, "postgresql://db/x"))


@pytest.mark.parametrize(
    ("path", "parser", "cls"),
    [found for found in with_settings() if any(item.name == "database_url" for item in declared(found[2]))],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_malformed_database_url_is_refused_by_every_command_that_takes_one(
    path: str, parser: argparse.ArgumentParser, cls: type[Settings]
) -> None:
    """The URL check belongs to the shared declaration, so no command can forget it (migrate and status
    had none); the message names the setting and never shows the password."""
    environ = minimal_environment(cls, "postgresql://app:hun%zzter2@db/x")
    with pytest.raises(
        SettingsError, match=r"--database-url \(POSTBOX_DATABASE_URL\): .*not a valid"
    ) as refused:
        load(cls, None, environ)
    assert "hun%zzter2" not in str(refused.value)
