"""The relay's ordering promise, written and judged: write_sequenced commits numbered events per aggregate
the way concurrent writers would, and check_delivery asserts that the broker holds every one of them, in
order per aggregate (tests.chaos.checker)."""

from __future__ import annotations

import random
import threading
import time

import psycopg

from postbox.relay.outbox import OutboxEvent, enqueue_many
from tests.support.kafka import Record


def write_sequenced(
    database_url: str,
    schema: str,
    aggregate_type: str,
    aggregates: list[str],
    events_per_aggregate: int,
    written: dict[str, tuple[str, int]],
    seed: int,
    pause: float = 0.004,
) -> None:
    """Commit events for `aggregates` in a random interleaving, 1-3 per transaction, seq per aggregate."""
    rng = random.Random(seed)
    next_seq = dict.fromkeys(aggregates, 0)
    with psycopg.connect(database_url) as conn:
        while next_seq:
            batch = []
            for _ in range(rng.randint(1, 3)):
                if not next_seq:
                    break
                aggregate = rng.choice(sorted(next_seq))
                seq = next_seq[aggregate]
                batch.append(OutboxEvent(aggregate_type, aggregate, "Changed", {"seq": seq}))
                next_seq[aggregate] += 1
                if next_seq[aggregate] == events_per_aggregate:
                    del next_seq[aggregate]
            ids = enqueue_many(conn, batch, schema=schema)
            conn.commit()
            for event_id, event in zip(ids, batch, strict=True):
                written[str(event_id)] = (event.aggregate_id, event.payload["seq"])
            time.sleep(rng.random() * pause)  # pacing, not waiting: the writers' random interleaving


def sequenced_writers(
    database_url: str,
    schema: str,
    aggregate_type: str,
    written: dict[str, tuple[str, int]],
    writers: int = 3,
    aggregates: int = 10,
    events_per_aggregate: int = 40,
    pause: float = 0.004,
) -> list[threading.Thread]:
    """`writers` threads (not started) running write_sequenced, each on aggregates of its own
    (`w<n>-a<m>`), seeded by its number; together they write writers * aggregates * events_per_aggregate
    events into `written`."""
    return [
        threading.Thread(
            target=write_sequenced,
            args=(
                database_url,
                schema,
                aggregate_type,
                [f"w{w}-a{a}" for a in range(aggregates)],
                events_per_aggregate,
                written,
                w,
                pause,
            ),
        )
        for w in range(writers)
    ]


def check_delivery(records: list[Record], written: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Assert the checker finds nothing broken: every committed event arrived, duplicates are identical
    copies, per-aggregate order holds. Returns counts for the report."""
    from tests.chaos.checker import check  # noqa: PLC0415

    report = check(written, records)
    assert report.ok, "\n".join(
        [*report.lines(), f"lost e.g. {report.lost[:3]}", f"inversions e.g. {report.inversions[:5]}"]
    )
    return {"events": report.written, "duplicates": report.duplicates}
