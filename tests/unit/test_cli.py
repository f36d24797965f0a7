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
