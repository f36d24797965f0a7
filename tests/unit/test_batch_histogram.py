"""BatchHistogram against prometheus_client's own Histogram: the same observations must read the same."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from postbox.relay.outbox.metrics import COMMIT_TO_ACK_BUCKETS, BatchHistogram


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The registry's lines, without the _created sample only prometheus_client's Histogram has, and
    without the sum (added up in another order, so equal only to rounding: compared apart)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line and "_sum" not in line]


def test_reads_exactly_as_prometheus_clients_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("x_seconds", "doc", COMMIT_TO_ACK_BUCKETS, ours)
    single = Histogram("x_seconds", "doc", registry=theirs, buckets=COMMIT_TO_ACK_BUCKETS)
    chooser = random.Random(7)
    # Every bound itself (le is inclusive), just above and below each, 0, and beyond the last bound.
    values = [0.0, 1000.0, *COMMIT_TO_ACK_BUCKETS]
    values += [math.nextafter(b, math.inf) for b in COMMIT_TO_ACK_BUCKETS]
    values += [math.nextafter(b, 0.0) for b in COMMIT_TO_ACK_BUCKETS]
    values += [chooser.uniform(0, 400) for _ in range(500)]
    chooser.shuffle(values)
    for start in range(0, len(values), 37):  # in batches of uneven size, as the relay's batches come
        batched.observe_many(values[start : start + 37])
    for value in values:
        single.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("x_seconds_sum") == pytest.approx(theirs.get_sample_value("x_seconds_sum"))
    assert any(line.startswith('x_seconds_bucket{le="+Inf"} 556.0') for line in _exposition(ours))


def test_an_empty_batch_changes_nothing() -> None:
    registry = CollectorRegistry()
    batched = BatchHistogram("y_seconds", "doc", (0.1, 1), registry)
    batched.observe_many([])
    assert registry.get_sample_value("y_seconds_count") == 0.0
    batched.observe_many([0.1, 2])
    assert registry.get_sample_value("y_seconds_bucket", {"le": "0.1"}) == 1.0
    assert registry.get_sample_value("y_seconds_sum") == pytest.approx(2.1)


def test_refuses_buckets_out_of_order() -> None:
    with pytest.raises(ValueError, match="ascending"):
        BatchHistogram("z_seconds", "doc", (1, 0.5), CollectorRegistry())
