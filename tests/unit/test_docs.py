"""The documentation (README.md and docs/) against the code: the generated references are what the
declarations say today, every `postbox` command a page shows is one the parser takes, the tutorial's
commands need nothing but what `postbox dev env` prints, and every Python block is Python. (The commands
are run on real servers by tests/acceptance/test_readme_commands.py, tests/integration/test_examples.py
and tests/integration/test_operator_errors.py, which find them through tests/docs.py too.)"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from postbox.relay.cli import build_parser
from postbox.relay.core.settings import SettingsError, load
from tests import docs


@pytest.mark.parametrize(
    ("page", "marker", "make"), docs.GENERATED, ids=[marker for _, marker, _ in docs.GENERATED]
)
def test_each_generated_block_is_what_the_declarations_say(
    page: Path, marker: str, make: Callable[[], str]
) -> None:
    assert docs.generated_block(page, marker) == make(), (
        f"{page.relative_to(docs.REPO)} <!-- {marker} --> is stale: run `python -m tests.docs`"
    )


def _sh_lines() -> list[tuple[Path, str]]:
    """Every command line of the documentation's ```sh blocks, without its comment."""
    found = []
    for page in docs.pages():
        for _indent, body in re.findall(r"^( *)```sh\n(.*?)^\1```", page.read_text(), re.M | re.S):
            for line in textwrap.dedent(body).splitlines():
                command = line.split("  #", 1)[0].strip()
                if command and not command.startswith("#"):
                    found.append((page, command))
    return found


def _postbox_commands(lines: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """The `postbox` commands among `lines`, those inside `$(...)` too."""
    commands = []
    for page, line in lines:
        if line.startswith("postbox "):
            commands.append((page, line))
        commands += [(page, inner) for inner in re.findall(r"\$\((postbox [^)]*)\)", line)]
    return commands


SHOWN = _postbox_commands(_sh_lines())


def _parse(command: str) -> object:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return build_parser().parse_args(shlex.split(command)[1:])
        except SystemExit:
            raise AssertionError(f"`{command}` is not a postbox command: {stderr.getvalue()}") from None


def test_the_documentation_shows_the_commands_this_test_walks() -> None:
    walked = {command.split(" --", 1)[0] for _, command in SHOWN}
    for expected in ("postbox migrate", "postbox relay run", "postbox inbox consume", "postbox dev up"):
        assert expected in walked, sorted(walked)


@pytest.mark.parametrize(
    "command", sorted({command for _, command in SHOWN}), ids=lambda command: command[:60]
)
def test_every_postbox_command_the_documentation_shows_parses(command: str) -> None:
    _parse(command)


TUTORIAL = docs.DOCS / "tutorial" / "index.md"
# What `eval "$(postbox dev env)"` exports (relay.devstack.stack.StackInfo.as_env), with made-up addresses.
DEV_ENV = {
    "POSTBOX_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/postgres",
    "POSTBOX_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
}


@pytest.mark.parametrize(
    "command", [command for page, command in SHOWN if page == TUTORIAL], ids=lambda command: command[:60]
)
def test_the_tutorials_commands_need_only_what_postbox_dev_env_prints(command: str) -> None:
    args = _parse(command)
    cls = getattr(args, "settings_class", None)
    if cls is None:
        return
    try:
        load(cls, args, DEV_ENV)  # type: ignore[arg-type]
    except SettingsError as exc:
        raise AssertionError(f'`{command}` after `eval "$(postbox dev env)"`: {exc}') from None


def test_the_tutorial_writes_with_an_example_the_integration_tests_run() -> None:
    tutorial = TUTORIAL.read_text()
    examples = (docs.REPO / "examples" / "README.md").read_text()
    placed = [line for _, line in _sh_lines() if line.startswith("python examples/")]
    assert placed, "no example command in the documentation"
    for line in placed:
        assert line in examples, (
            f"{line!r} is not a command examples/README.md gives (and test_examples runs)"
        )
    assert any(line in tutorial for line in placed)


def _python_blocks() -> list[tuple[Path, str]]:
    blocks = []
    for page in docs.pages():
        for indent, body in re.findall(r"^( *)```python\n(.*?)^\1```", page.read_text(), re.M | re.S):
            blocks.append((page, textwrap.dedent(body) if indent else body))
    return blocks


# Not a statement but the signature the text explains, with its keyword-only marker.
SIGNATURES = ("enqueue(conn_or_cursor, aggregate_type",)


CODE = [(page, code) for page, code in _python_blocks() if not code.startswith(SIGNATURES)]


@pytest.mark.parametrize(
    ("page", "code"), CODE, ids=[f"{page.name}:{code.splitlines()[0][:40]}" for page, code in CODE]
)
def test_every_python_block_is_python(page: Path, code: str) -> None:
    try:
        compile(code, str(page), "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        raise AssertionError(f"{page.relative_to(docs.REPO)}: {exc}\n{code}") from None
