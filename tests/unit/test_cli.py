import argparse

import pytest

from relay import __version__
from relay.cli import build_parser, main
from relay.core.cli_options import duration


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"postbox {__version__}"


def test_every_relay_run_flag_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTBOX_BATCH_SIZE", "77")
    monkeypatch.setenv("POSTBOX_NO_LISTEN", "true")
    monkeypatch.setenv("POSTBOX_SCHEMA", "events")
    args = build_parser().parse_args(["relay", "run"])
    assert (args.batch_size, args.no_listen, args.schema) == (77, True, "events")
    flag_wins = build_parser().parse_args(["relay", "run", "--batch-size", "5"])
    assert flag_wins.batch_size == 5


def test_a_switch_that_is_not_given_is_false_not_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTBOX_NO_LISTEN", raising=False)
    monkeypatch.delenv("POSTBOX_DELETE_ON_PUBLISH", raising=False)
    args = build_parser().parse_args(["relay", "run"])
    assert args.no_listen is False
    assert args.delete_on_publish is False
    monkeypatch.setenv("POSTBOX_DELETE_ON_PUBLISH", "yes")
    assert build_parser().parse_args(["relay", "run"]).delete_on_publish is True


def test_a_malformed_environment_value_is_rejected_with_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POSTBOX_BATCH_SIZE", "many")
    with pytest.raises(SystemExit):
        build_parser()
    assert "POSTBOX_BATCH_SIZE='many' is not valid" in capsys.readouterr().err


def test_relay_run_without_a_database_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("POSTBOX_DATABASE_URL", raising=False)
    with pytest.raises(SystemExit):
        main(["relay", "run", "--kafka-bootstrap", "k:1"])
    assert "POSTBOX_DATABASE_URL" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1e20", "inf", "1e400d", "nan"])
def test_an_absurd_duration_is_a_clear_error(text: str) -> None:
    # Found by the atheris target settings: 1e20 and inf escaped as OverflowError.
    with pytest.raises(argparse.ArgumentTypeError, match="is not a duration"):
        duration(text)


def _readme_flag_rows() -> dict[str, list[str]]:
    from tests.support import REPO  # noqa: PLC0415

    text = (REPO / "README.md").read_text()
    table = text.split("| flag | env | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        rows[cells[0].split()[0]] = cells
    return rows


def _subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        parser = choices[name]
    return parser


def test_the_readme_flag_table_matches_relay_run_flag_for_flag() -> None:
    """Every `postbox relay run` flag is in the README's table with its variable and default, and the table
    names no flag the command lacks: the table cannot drift from the parser."""
    import re  # noqa: PLC0415

    parser = build_parser()
    relay = next(
        a for a in parser._subparsers._group_actions[0].choices["relay"]._actions if a.dest == "relay_command"
    )  # type: ignore[union-attr]
    run = relay.choices["run"]  # type: ignore[attr-defined]
    rows = _readme_flag_rows()
    flags = {}
    for action in run._actions:
        long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if long:
            flags[long[0]] = action
    assert set(rows) == set(flags), (
        f"README only: {set(rows) - set(flags)}; parser only: {set(flags) - set(rows)}"
    )
    for flag, action in flags.items():
        _, env, default, _ = rows[flag]
        named = re.search(r"\(env (\w+)", action.help or "")
        if named:
            assert env == named.group(1), flag
        if action.default in (None, False, []):
            assert not re.fullmatch(r"[\d.]+", default), f"{flag}: README default {default!r}, parser none"
        elif isinstance(action.default, int | float):
            assert float(default) == float(action.default), f"{flag}: {default} vs {action.default}"
        else:
            assert default == str(action.default), f"{flag}: {default!r} vs {action.default!r}"


def test_dev_env_answers_for_the_stack_it_is_asked_about(tmp_path: object) -> None:
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from tests.support import REPO  # noqa: PLC0415

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
            [sys.executable, "-m", "relay.cli", "dev", "env", *args],
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
