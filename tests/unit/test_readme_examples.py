"""The documentation's inbox example is the code the demo runs (postbox.inbox.example), and it handles the
event the documentation's writers send: what a newcomer copies from one page works with what they copy from
another. The README and the pages under docs/ are read as one (tests/docs.py), so this holds wherever the
examples are shown. (Both run on real servers elsewhere: the example in
tests/acceptance/test_readme_commands.py and tests/integration/test_inbox_example.py, the writers in
tests/integration/test_examples.py.)"""

from __future__ import annotations

import ast
import re

from tests import docs
from tests.support.repo import REPO

BLOCKS = [code for _, code in docs.fenced("python")]


def _block_after(marker: str) -> str:
    text = docs.text()
    assert text.count(marker) == 1, f"the documentation should say {marker!r} once"
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, text.index(marker))
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


def test_the_documented_inbox_example_is_the_code_the_demo_runs() -> None:
    example = _shape((REPO / "inbox" / "example.py").read_text())
    documented = _block_after("This is `inbox/example.py`, which the demo runs:")
    assert _shape(documented) == example
    # Every other block that shows the example's inbox (the README's) is the same code too.
    shown = [block for block in BLOCKS if 'inbox = Inbox("orders-projection")' in block]
    assert len(shown) >= 2, "the README and the inbox page both show the example"
    for block in shown:
        assert _shape(block) == example, block


def test_the_documented_writers_send_what_the_inbox_example_handles() -> None:
    writers = [block for block in BLOCKS if re.search(r'enqueue(?:_async)?\([^,]+, "order", order_id', block)]
    assert len(writers) >= 2, "the README and the writers' page both show writers"
    assert any("from postbox import OutboxEvent" in block for block in writers)
    handled = _block_after("This is `inbox/example.py`")
    assert '@inbox.handler("OrderChanged")' in handled
    for block in writers:
        sent = set(re.findall(r'enqueue(?:_async)?\([^,]+, "order", order_id, "(\w+)"', block))
        assert sent == {"OrderChanged"}, sent
        for field in ("order", "total", "seq"):
            assert f'"{field}"' in block or f"{field}=" in block, f"the writers' payload carries {field}"
