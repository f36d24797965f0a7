"""Where the checkout is: the root of the repository, the working directory of every child process."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
