import subprocess
import sys

import pytest

from postbox.inbox.settings import ConsumeSettings, WorkSettings
from postbox.relay import __version__
from postbox.relay.cli import build_parser, commands_reference, main, services
from postbox.relay.core.settings import Settings, SettingsError, duration, load, reference_table
from postbox.relay.outbox.settings import RelaySettings
from tests.support.repo import REPO

DB = {"POSTBOX_DATABASE_URL": "postgresql://db/x", "POSTBOX_KAFKA_BOOTSTRAP": "k:9092"}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"postbox {__version__}"


def test_relay_run_takes_each_setting_from_flag_then_variable_then_default() -> None:
    env = {"POSTBOX_RELAY_BATCH_SIZE": "77", "POSTBOX_RELAY_LISTEN": "false", "POSTBOX_SCHEMA": "events"}
    loaded = load(RelaySettings, build_parser().parse_args(["relay", "run"]), {**env, **DB})
    settings = loaded.settings
    assert (settings.batch_size, settings.listen, settings.schema, settings.lanes) == (77, False, "events", 2)
    assert loaded.sources["batch_size"] == "env POSTBOX_RELAY_BATCH_SIZE"
    assert loaded.sources["lanes"] == "default"
    args = build_parser().parse_args(["relay", "run", "--batch-size", "5", "--listen"])
    flag_wins = load(RelaySettings, args, {**env, **DB})
    assert (flag_wins.settings.batch_size, flag_wins.settings.listen) == (5, True)
    assert flag_wins.sources["batch_size"] == "flag"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "POSTBOX_RELAY_BATCH_SIZE",
            "many",
            r"^--batch-size \(POSTBOX_RELAY_BATCH_SIZE\): 'many' is not a whole",
        ),
        (
            "POSTBOX_RELAY_BATCH_SIZE",
            "0",
            r"^--batch-size \(POSTBOX_RELAY_BATCH_SIZE\): 0 is outside 1..10000",
        ),
        (
            "POSTBOX_RELAY_LEASE_TTL",
            "nan",
            r"^--lease-ttl \(POSTBOX_RELAY_LEASE_TTL\): 'nan' is not a finite",
        ),
        ("POSTBOX_RELAY_LISTEN", "maybe", r"^--listen \(POSTBOX_RELAY_LISTEN\): 'maybe' is not a boolean"),
        (
            "POSTBOX_METRICS_ADDRESS",
            "9400",
            r"^--metrics-address \(POSTBOX_METRICS_ADDRESS\): '9400' is not host",
        ),
    ],
)
def test_a_malformed_value_is_rejected_naming_its_flag_and_variable(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        load(RelaySettings, None, {**DB, variable: value})


def _run(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env},
        check=False,
        timeout=60,
    )


def test_a_command_reads_only_its_own_settings() -> None:
    """Bad variables of other services break neither `--version` nor `migrate` (which then names the one
    setting it is missing)."""
    bad = {
        "POSTBOX_RELAY_BATCH_SIZE": "abc",
        "POSTBOX_RELAY_LISTEN": "maybe",
        "POSTBOX_WEBHOOK_PORT": "http",
        "POSTBOX_INBOX_MAX_BATCH_BYTES": "lots",
    }
    version = _run("--version", env=bad)
    assert version.returncode == 0, version.stderr
    migrate = _run("migrate", env=bad)
    assert migrate.returncode == 2
    assert "--database-url (POSTBOX_DATABASE_URL): required" in migrate.stderr
    assert "BATCH_SIZE" not in migrate.stderr
    assert "LISTEN" not in migrate.stderr


def test_help_shows_each_commands_own_default_without_reading_the_environment() -> None:
    env = {"POSTBOX_RELAY_BATCH_SIZE": "not read by --help", "COLUMNS": "250"}
    work = _run("inbox", "work", "--help", env=env)
    assert work.returncode == 0, work.stderr
    assert "(env POSTBOX_WEBHOOK_BATCH_SIZE, default 20)" in work.stdout
    relay = _run("relay", "run", "--help", env=env)
    assert "(env POSTBOX_RELAY_BATCH_SIZE, default 1000 (queue) / 4000 (log))" in relay.stdout
    consume = _run("inbox", "consume", "--help", env=env)
    assert "(env POSTBOX_INBOX_BATCH_SIZE, default 500)" in consume.stdout


def test_an_earlier_name_still_works_for_one_release_with_a_warning_naming_the_new_one() -> None:
    loaded = load(RelaySettings, None, {**DB, "POSTBOX_LEASE_TTL": "30", "POSTBOX_NO_LISTEN": "true"})
    assert loaded.settings.lease_ttl == 30.0
    assert loaded.settings.listen is False  # POSTBOX_NO_LISTEN said the opposite of listen
    assert loaded.sources["lease_ttl"] == "deprecated POSTBOX_LEASE_TTL"
    assert (
        "POSTBOX_LEASE_TTL is deprecated and will be removed: set POSTBOX_RELAY_LEASE_TTL" in loaded.warnings
    )
    assert "POSTBOX_NO_LISTEN is deprecated and will be removed: set POSTBOX_RELAY_LISTEN" in loaded.warnings
    both = load(RelaySettings, None, {**DB, "POSTBOX_LEASE_TTL": "30", "POSTBOX_RELAY_LEASE_TTL": "40"})
    assert both.settings.lease_ttl == 40.0  # the new name wins
    assert both.warnings == []


def test_the_deprecation_warning_is_logged_by_the_command_that_reads_the_name() -> None:
    env = {
        "POSTBOX_PRUNE_BATCH_SIZE": "5",
        "POSTBOX_DATABASE_URL": "postgresql://127.0.0.1:1/x?connect_timeout=1",
    }
    status = _run("--log-format", "json", "relay", "status", env=env)
    assert "POSTBOX_PRUNE_BATCH_SIZE" not in status.stderr  # relay status does not read it
    pruned = _run("--log-format", "json", "relay", "prune", env=env)
    assert '"event": "setting_deprecated"' in pruned.stderr
    assert "set POSTBOX_RELAY_PRUNE_BATCH_SIZE" in pruned.stderr


@pytest.mark.parametrize("cls", [RelaySettings, ConsumeSettings, WorkSettings])
def test_the_shared_batch_size_is_refused_with_the_names_to_use(cls: type[Settings]) -> None:
    with pytest.raises(SettingsError) as raised:
        load(cls, None, {**DB, "POSTBOX_BATCH_SIZE": "1000"})
    message = str(raised.value)
    assert message.startswith("POSTBOX_BATCH_SIZE is no longer read")
    for name in ("POSTBOX_RELAY_BATCH_SIZE", "POSTBOX_INBOX_BATCH_SIZE", "POSTBOX_WEBHOOK_BATCH_SIZE"):
        assert name in message


def test_relay_run_without_a_database_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("POSTBOX_DATABASE_URL", raising=False)
    monkeypatch.delenv("POSTBOX_DATABASE_URL_FILE", raising=False)
    with pytest.raises(SystemExit):
        main(["relay", "run", "--kafka-bootstrap", "k:1"])
    assert "--database-url (POSTBOX_DATABASE_URL): required" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1e20", "inf", "1e400d", "nan"])
def test_an_absurd_duration_is_a_clear_error(text: str) -> None:
    # Found by the atheris target settings: 1e20 and inf escaped as OverflowError.
    with pytest.raises(ValueError, match="is not a duration"):
        duration(text)


def test_the_settings_reference_tables_are_the_declarations() -> None:
    """Each service's table in docs/reference/settings.md is exactly what `postbox config reference` prints:
    the tables cannot drift from the settings."""
    from tests.docs import DOCS, generated_block  # noqa: PLC0415

    for service, cls in services().items():
        table = generated_block(DOCS / "reference" / "settings.md", f"settings:{service}")
        assert table == reference_table(cls), (
            f"docs/reference/settings.md's {service} table is stale: run `python -m tests.docs`"
        )


def test_the_command_reference_is_the_parser() -> None:
    """docs/reference/cli.md is what `postbox config reference --commands` prints, and that is every command
    the parser has, with every option."""
    from tests.docs import DOCS, generated_block  # noqa: PLC0415

    reference = commands_reference()
    assert generated_block(DOCS / "reference" / "cli.md", "commands") == reference, (
        "docs/reference/cli.md is stale: run `python -m tests.docs`"
    )
    for path in ("postbox relay run", "postbox inbox consume", "postbox config reference", "postbox dev up"):
        assert f"\n## {path}\n" in reference
    for option in ("`--kafka-bootstrap KAFKA_BOOTSTRAP`", "`--commands`", "`--older-than OLDER_THAN`"):
        assert option in reference, option


def test_dev_env_answers_for_the_stack_it_is_asked_about(tmp_path: object) -> None:
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from tests.support.repo import REPO  # noqa: PLC0415

    cache = Path(str(tmp_path))
    for name, port in (("default", 5001), ("demo", 5002)):
        state = {
            "database_url": f"postgresql://postgres@127.0.0.1:{port}/postgres",
            "kafka_bootstrap": f"127.0.0.1:{port + 1000}",
            "postgres_version": "18.6",
            "kafka_version": "4.1.1",
            "pid": os.getpid(),  # alive for the length of this test
        }
        (cache / f"stack-{name}.json").write_text(json.dumps(state))
    (cache / "stack-gone.json").write_text(json.dumps({**state, "pid": 2**22 + 12345}))

    def dev_env(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "postbox", "dev", "env", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "POSTBOX_CACHE_DIR": str(cache)},
            check=False,
        )

    default = dev_env()
    assert "# postbox dev stack 'default'" in default.stdout
    assert "export POSTBOX_DATABASE_URL=postgresql://postgres@127.0.0.1:5001/postgres" in default.stdout
    demo = dev_env("--name", "demo")
    assert "export POSTBOX_KAFKA_BOOTSTRAP=127.0.0.1:6002" in demo.stdout
    gone = dev_env("--name", "gone")
    assert gone.returncode == 1
    assert "no local stack named 'gone' is running; running: default, demo" in gone.stderr
