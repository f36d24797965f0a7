"""The README's first command does what it says: the relay on a real local stack, events flowing."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import REPO


def test_the_demo_shows_events_flowing_and_nothing_missing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relay.cli", "dev", "demo", "--duration", "4", "--rate", "10"],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"<- outbox\.event\.order\[\d\]@\d+", result.stdout)
    summary = re.search(
        r"written (\d+), received (\d+) \((\d+) duplicates\), missing 0; relay exited 0", result.stdout
    )
    assert summary, result.stdout[-2000:]
    assert int(summary.group(1)) >= 20
