"""Exponential backoff with full jitter, shared by every retry loop in postbox."""

from __future__ import annotations

import random


def backoff_delay(failures: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Seconds to wait after `failures` consecutive failures, jittered so peers that failed together
    do not retry together."""
    return random.uniform(0, min(cap, base * 2 ** min(failures, 16)))  # noqa: S311  (jitter, not crypto)
