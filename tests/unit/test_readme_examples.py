"""The README's inbox example is the code the demo runs (postbox.inbox.example), and it handles the event
the README's writers send: what a newcomer copies from one section works with what they copy from the
other. (Both run on real servers elsewhere: the example in tests/acceptance/test_readme_commands.py and
tests/integration/test_inbox_example.py, the writers in tests/integration/test_examples.py.)"""

from __future__ import annotations

import ast
import re

from tests.support import REPO

README = (REPO / "README.md").read_text()


BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _block_after(marker: str) -> str:
    start = README.index(marker)
    match = re.compile(r"```python\n(.*?)```", re.S).search(README, start)
    assert match is not None, f"no python block after {marker!r}"
    return match.group(1)


def _shape(code: str) -> str:
    """The code's syntax tree without annotations and typing-only imports: what it does, not its typing."""
    tree = ast.parse(code)
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.ImportFrom) and node.module in ("__future__", "typing"))
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # the docstring
    ]
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        if isinstance(node, ast.FunctionDef):
            node.returns = None
    return ast.dump(tree)


def test_the_readme_inbox_example_is_the_code_the_demo_runs() -> None:
    readme = _block_after("This is `inbox/example.py`, which the demo runs:")
    assert _shape(readme) == _shape((REPO / "inbox" / "example.py").read_text())


def test_the_readme_writers_send_what_the_inbox_example_handles() -> None:
    [writers] = [block for block in BLOCKS if "from postbox import OutboxEvent" in block]
    sent = set(re.findall(r'enqueue(?:_async)?\([^,]+, "order", order_id, "(\w+)"', writers))
    assert sent == {"OrderChanged"}, sent
    assert '@inbox.handler("OrderChanged")' in _block_after("This is `inbox/example.py`")
    for field in ("order", "total", "seq"):
        assert f'"{field}"' in writers, f"the writers' payload carries {field}"
