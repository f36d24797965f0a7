"""Each atheris target (tests/fuzz/targets.py) for a bounded number of runs, with a fixed seed so a failure
reproduces. Longer runs: `python -m tests.fuzz.run TARGET -max_total_time=600`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.repo import REPO

TARGETS = [
    "stripe",
    "shopify",
    "marqeta",
    "generic",
    "message_id",
    "outbox_row",
    "settings",
    "relay_row",
    "secrets",
]
RUNS = 20_000


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_finds_no_crash(target: str, tmp_path: object) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.run",
            target,
            f"-atheris_runs={RUNS}",
            "-seed=7",
            "-max_len=4096",
            f"-artifact_prefix={tmp_path}/",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "Done" in result.stderr, result.stderr[-2000:]  # it really ran its runs
