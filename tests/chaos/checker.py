"""The independent checker. It trusts nothing the processes say about themselves: it compares what the
writers committed (outbox rows), what the broker holds (every record, read from the beginning), and what
the consumers applied (their effect rows), and reports what broke. Pure: inputs in, report out.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class BrokerRecord(Protocol):
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


@dataclass
class Report:
    written: int
    published: int = 0  # distinct events on the broker
    broker_records: int = 0  # every copy
    duplicates: int = 0  # copies beyond the first (allowed)
    duplicates_differing: list[str] = field(default_factory=list)  # a copy that is not identical (never ok)
    lost: list[str] = field(default_factory=list)  # committed, never on the broker
    unexpected: list[str] = field(default_factory=list)  # on the broker, never committed
    inversions: list[tuple[str, int, int]] = field(default_factory=list)  # (aggregate, seq seen, seq after)
    applied: int | None = None  # distinct events consumers applied (None: no consumers checked)
    double_effects: list[str] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)  # processes that died on their own (the soak sets it)

    @property
    def ok(self) -> bool:
        return not (
            self.duplicates_differing
            or self.lost
            or self.unexpected
            or self.inversions
            or self.double_effects
            or self.not_applied
        )

    def lines(self) -> list[str]:
        rows = [
            ("events written (committed)", self.written),
            ("events published (distinct)", self.published),
            ("broker records (all copies)", self.broker_records),
            ("duplicates (same id, allowed)", self.duplicates),
            ("duplicates that differ", len(self.duplicates_differing)),
            ("lost", len(self.lost)),
            ("on the broker but never committed", len(self.unexpected)),
            ("per-aggregate order inversions", len(self.inversions)),
        ]
        rows.append(("processes that died on their own", len(self.crashed)))
        if self.applied is not None:
            rows += [
                ("events applied downstream", self.applied),
                ("double effects", len(self.double_effects)),
                ("committed but never applied", len(self.not_applied)),
            ]
        return [f"{name:36} {value}" for name, value in rows]


def check(
    written: Mapping[str, tuple[str, int]],
    records: Iterable[BrokerRecord],
    effects: Iterable[str] | None = None,
) -> Report:
    """`written`: event id -> (aggregate id, sequence within the aggregate), from the committed outbox.
    `records`: the broker's records. `effects`: one event id per effect a consumer applied.

    Order is judged on the first copy of each event, in partition-offset order (an aggregate's key puts
    all its events on one partition): each aggregate's sequence numbers must rise.
    """
    report = Report(written=len(written))
    first: dict[str, BrokerRecord] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        report.broker_records += 1
        event_id = record.headers.get("id", b"").decode()
        if event_id in first:
            report.duplicates += 1
            if (record.key, record.value) != (first[event_id].key, first[event_id].value):
                report.duplicates_differing.append(event_id)
            continue
        first[event_id] = record
    report.published = len(first)
    report.lost = sorted(set(written) - set(first))
    report.unexpected = sorted(set(first) - set(written))
    last_seq: dict[str, int] = {}
    for event_id, record in sorted(first.items(), key=lambda kv: (kv[1].partition, kv[1].offset)):
        if event_id not in written:
            continue
        aggregate, seq = written[event_id]
        if record.key != aggregate.encode() or json.loads(record.value or b"null").get("seq") != seq:
            report.duplicates_differing.append(event_id)  # not what was committed under this id
        if seq <= last_seq.get(aggregate, -1):
            report.inversions.append((aggregate, last_seq[aggregate], seq))
        last_seq[aggregate] = max(seq, last_seq.get(aggregate, -1))
    if effects is not None:
        counts = Counter(effects)
        report.applied = len(counts)
        report.double_effects = sorted(e for e, n in counts.items() if n > 1)
        report.not_applied = sorted(set(written) - set(counts))
    return report
