"""What a finished batch tells the metrics and the log: stage times, commit-to-ack latency, rows published,
parked, retried and fenced, and (at debug level) the batch's wall-clock stage times for tests/bench's
latency breakdown."""

from __future__ import annotations

import logging
import time
from collections import Counter
from operator import attrgetter

import structlog

from postbox.relay.outbox.batch import InFlight
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import BatchOutcome, RowState

log = structlog.get_logger("postbox.relay")
_ID = attrgetter("id")


def report_batch(
    metrics: RelayMetrics, batch: InFlight, outcome: BatchOutcome, marked: int, acked_at: float
) -> None:
    """`marked`: the rows whose shard was still ours at the mark; `acked_at`: when the last ack came."""
    committed_at = time.time()
    seconds = time.perf_counter() - batch.started
    stages = metrics.batch_stage_seconds
    stages.labels("claim").observe(batch.claim_seconds)
    stages.labels("publish").observe(max(0.0, acked_at - batch.claimed_at))
    stages.labels("mark").observe(max(0.0, committed_at - acked_at))
    # Wall clock against the database's created_at: comparable while the clocks are in sync.
    if outcome.published == len(batch.rows):  # the usual batch: counted without a look at each row
        published = Counter(batch.topics)
        metrics.commit_to_ack.observe_many([max(0.0, acked_at - row.created_epoch) for row in batch.rows])
    else:
        published = Counter()
        waited: list[float] = []
        # outcome.rows is in the order of batch.rows (decide keeps it).
        for row, topic, row_outcome in zip(batch.rows, batch.topics, outcome.rows, strict=True):
            if row_outcome.state is RowState.PUBLISHED:
                published[topic] += 1
                waited.append(max(0.0, acked_at - row.created_epoch))
            elif row_outcome.state is RowState.FAILED:
                metrics.failed.labels(metrics.topic_label(topic)).inc()
                log.error(
                    "relay_row_parked", row_id=row_outcome.row_id, topic=topic, reason=row_outcome.error
                )
        metrics.commit_to_ack.observe_many(waited)
    for topic, count in published.items():
        metrics.published.labels(metrics.topic_label(topic)).inc(count)
    metrics.retried.inc(outcome.retried)
    metrics.batch_rows.observe(len(batch.rows))
    metrics.batch_seconds.observe(seconds)
    if marked < len(batch.rows):
        # Our lease on some shard expired mid-batch: its rows stay pending for the new owner (duplicates).
        metrics.fenced.inc(len(batch.rows) - marked)
        log.warning("relay_mark_fenced", unmarked=len(batch.rows) - marked)
    if outcome.retried:
        log.warning(
            "relay_rows_retried",
            count=outcome.retried,
            reason=next((o.error for o in outcome.rows if o.state is RowState.PENDING), None),
        )
    if log.is_enabled_for(logging.DEBUG):  # its arguments (a list of the batch's ids) cost even unlogged
        log.debug(
            "relay_batch_published",
            rows=len(batch.rows),
            published=outcome.published,
            failed=outcome.failed,
            retried=outcome.retried,
            seconds=round(seconds, 4),
            # Wall-clock stage times and the rows, for tests/bench's latency breakdown (debug only).
            woke_at=batch.woke_at,
            claim_started_at=batch.claimed_at - batch.claim_seconds,
            claimed_at=batch.claimed_at,
            acked_at=acked_at,
            committed_at=committed_at,
            row_ids=list(map(_ID, batch.rows)),
        )
