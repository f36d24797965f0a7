"""Figures from measurements and how they are printed: medians with their spread over runs, percentiles
of latencies, and the shares and quantiles of a Prometheus histogram."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def median_spread(values: list[float], decimals: int = 0) -> str:
    def show(value: float) -> str:
        return f"{value:,.{decimals}f}"

    if len(values) == 1:
        return show(values[0])
    spread = f"min {show(min(values))}, max {show(max(values))}, n={len(values)}"
    return f"{show(statistics.median(values))} ({spread})"


def repeat(runs: int, measure: Callable[[], float]) -> list[float]:
    return [measure() for _ in range(runs)]


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))]


def quantiles(values: list[float]) -> str:
    return (
        f"p50 {percentile(values, 0.5):.1f}  p99 {percentile(values, 0.99):.1f}  "
        f"p999 {percentile(values, 0.999):.1f}"
    )


def share_within(values: list[float], bound: float) -> float:
    return sum(1 for v in values if v <= bound) / len(values) if values else 0.0


def histogram_shares(metrics: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative share of observations at each bucket bound."""
    counts: dict[float, float] = {}
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[float(bound)] = float(line.rsplit(" ", 1)[1])
    total = counts.get(float("inf"), 0.0)
    return {bound: count / total for bound, count in sorted(counts.items())} if total else {}


def histogram_quantile(shares: dict[float, float], q: float) -> float:
    """The q-quantile of a histogram, interpolated linearly inside its bucket (as Prometheus does)."""
    lower, below = 0.0, 0.0
    for bound, share in shares.items():
        if share >= q:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (q - below) / max(share - below, 1e-12)
        lower, below = bound, share
    return lower
