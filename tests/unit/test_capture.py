"""The pure parts of `postbox capture`: column lists as flags give them, and the options stored with a
capture (Debezium's names, only those that differ from Debezium's defaults)."""

from __future__ import annotations

import pytest

from postbox.relay.capture.admin import SOURCE_VERSION, CaptureOptions, column_list
from postbox.relay.cli import build_parser


def test_column_lists_split_on_commas_and_refuse_empty_names() -> None:
    assert column_list("a") == ["a"]
    assert column_list(" a , b ") == ["a", "b"]
    for bad in ("", "a,,b", "a,", " , "):
        with pytest.raises(ValueError, match="name each column"):
            column_list(bad)


def test_only_options_that_differ_from_debeziums_defaults_are_stored() -> None:
    assert CaptureOptions().debezium_options() == {}
    chosen = CaptureOptions(
        tombstones_on_delete=False, decimal_handling_mode="string", time_precision_mode="connect"
    )
    assert chosen.debezium_options() == {
        "tombstones.on.delete": "false",
        "decimal.handling.mode": "string",
        "time.precision.mode": "connect",
    }


def test_the_source_version_names_postbox() -> None:
    assert SOURCE_VERSION.startswith("postbox-")


def test_the_add_command_refuses_both_column_lists_and_an_empty_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    for argv in (
        ["capture", "add", "t", "--columns", "a", "--exclude-columns", "b"],
        ["capture", "add", "t", "--key-columns", "a,,b"],
        ["capture", "add", "t", "--decimal-handling-mode", "fast"],
    ):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2
    assert "name each column" in capsys.readouterr().err
    args = parser.parse_args(["capture", "add", "shop.orders", "--columns", "id, total"])
    assert (args.table, args.columns, args.exclude_columns) == ("shop.orders", ["id", "total"], None)
