"""The documentation as the tests read it: README.md and every page under docs/, so a command or an example
is found wherever it is shown, and a test that follows the text keeps following it when a page moves.

`python -m tests.docs` writes the generated blocks again (the settings tables and the command reference,
from the declarations); tests/unit/test_docs.py fails while one is stale.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[Path]:
    """README.md first, then every page under docs/ in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def text() -> str:
    """Every page, one after the other."""
    return "\n\n".join(page.read_text() for page in pages())


def shown(prefix: str, *, indented: bool = False) -> list[str]:
    """Every line of the documentation that starts with `prefix` (after its indentation, with `indented`),
    without its trailing comment: as a reader would copy it."""
    found = []
    for line in text().splitlines():
        candidate = line.strip() if indented else line
        if candidate.startswith(prefix):
            found.append(candidate.split("  #", 1)[0].strip())
    return found


def command(prefix: str, *, indented: bool = False) -> str:
    """The one command line the documentation shows starting with `prefix`: every page that shows it shows the
    same line, so the test that runs it tests each of them."""
    lines = set(shown(prefix, indented=indented))
    assert lines, f"the documentation shows no command starting {prefix!r}"
    assert len(lines) == 1, f"the documentation shows {prefix!r} in more than one form: {sorted(lines)}"
    return lines.pop()


def fenced(language: str) -> list[tuple[Path, str]]:
    """Every ```language block of the documentation, with its page."""
    blocks = []
    for page in pages():
        blocks += [
            (page, body) for body in re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.M | re.S)
        ]
    return blocks


# ---------------------------------------------------------------------------------------------- generated


def _settings_table(service: str) -> str:
    from postbox.relay.cli import services  # noqa: PLC0415
    from postbox.relay.core.settings import reference_table  # noqa: PLC0415

    return reference_table(services()[service])


def _commands() -> str:
    from postbox.relay.cli import commands_reference  # noqa: PLC0415

    return commands_reference()


# page, the marker that opens the block, and what the block holds (the marker closing it is <!-- /NAME -->)
GENERATED: list[tuple[Path, str, Callable[[], str]]] = [
    *[
        (DOCS / "reference" / "settings.md", f"settings:{service}", lambda s=service: _settings_table(s))
        for service in ("relay", "inbox", "receiver", "webhook-worker")
    ],
    (DOCS / "reference" / "cli.md", "commands", _commands),
]


def _span(page_text: str, marker: str) -> tuple[int, int]:
    begin = f"<!-- {marker} -->\n"
    end = f"\n<!-- /{marker.split(':', 1)[0]} -->"
    start = page_text.index(begin) + len(begin)
    return start, page_text.index(end, start)


def generated_block(page: Path, marker: str) -> str:
    """What `page` holds between `<!-- marker -->` and its closing marker."""
    page_text = page.read_text()
    assert f"<!-- {marker} -->\n" in page_text, f"{page.relative_to(REPO)} has no block <!-- {marker} -->"
    start, stop = _span(page_text, marker)
    return page_text[start:stop]


def write_generated() -> list[str]:
    """Writes every generated block from the declarations; returns the blocks it changed."""
    changed = []
    for page, marker, make in GENERATED:
        page_text = page.read_text()
        start, stop = _span(page_text, marker)
        fresh = make()
        if page_text[start:stop] != fresh:
            page.write_text(page_text[:start] + fresh + page_text[stop:])
            changed.append(f"{page.relative_to(REPO)} <!-- {marker} -->")
    return changed


if __name__ == "__main__":
    written = write_generated()
    print("\n".join(f"wrote {block}" for block in written) or "every generated block is up to date")
    sys.exit(0)
