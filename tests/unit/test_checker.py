"""The checker must catch what it claims to catch: each kind of breakage, built by hand."""

import json
from dataclasses import dataclass, field

from tests.chaos.checker import check


@dataclass
class R:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes] = field(default_factory=dict)


def rec(offset: int, event_id: str, aggregate: str, seq: int, partition: int = 0) -> R:
    return R(
        partition, offset, aggregate.encode(), json.dumps({"seq": seq}).encode(), {"id": event_id.encode()}
    )


WRITTEN = {"e1": ("a", 0), "e2": ("a", 1), "e3": ("b", 0)}


def test_a_clean_run_with_a_duplicate_is_ok() -> None:
    report = check(
        WRITTEN,
        [rec(0, "e1", "a", 0), rec(1, "e3", "b", 0), rec(2, "e2", "a", 1), rec(3, "e1", "a", 0)],
        effects=["e1", "e2", "e3"],
    )
    assert report.ok
    assert (report.published, report.duplicates, report.applied) == (3, 1, 3)


def test_each_breakage_is_reported() -> None:
    report = check(
        WRITTEN,
        [
            rec(0, "e2", "a", 1),
            rec(1, "e1", "a", 0),
            rec(2, "ghost", "z", 0),
            R(0, 3, b"a", b'{"seq": 9}', {"id": b"e2"}),
        ],
        effects=["e1", "e1", "e2"],
    )
    assert report.lost == ["e3"]
    assert report.unexpected == ["ghost"]
    assert report.inversions == [("a", 1, 0)]
    assert report.duplicates_differing == ["e2"]
    assert report.double_effects == ["e1"]
    assert report.not_applied == ["e3"]
    assert not report.ok


def test_order_is_judged_per_partition_on_first_copies() -> None:
    # A duplicate of an early event arriving late is not an inversion.
    report = check(
        WRITTEN, [rec(0, "e1", "a", 0), rec(1, "e2", "a", 1), rec(2, "e1", "a", 0), rec(0, "e3", "b", 0, 1)]
    )
    assert report.ok
    assert report.duplicates == 1
