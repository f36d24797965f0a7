"""The README's first command (`make demo`, which runs `postbox dev demo`) does what it says: events
written in one service, published by the relay,
applied once by an inbox in another, on a real local stack."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.repo import REPO


def test_the_demo_shows_events_flowing_and_nothing_missing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "postbox", "dev", "demo", "--duration", "4", "--rate", "10"],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"<- outbox\.event\.order\[\d\]@\d+", result.stdout)
    summary = re.search(
        r"written (\d+), received \d+ \(\d+ duplicates\), missing 0; applied once by the inbox: (\d+); "
        r"projection: 7 orders, newest snapshot everywhere: True; relay exited 0, inbox exited 0",
        result.stdout,
    )
    assert summary, result.stdout[-2000:]
    assert int(summary.group(1)) >= 20
    assert summary.group(2) == summary.group(1), "every event applied exactly once downstream"
