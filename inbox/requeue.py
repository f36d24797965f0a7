"""`postbox inbox requeue`: parked messages read again from Kafka by their coordinates and applied, each in a
transaction of its own, through the same Applier as a batch (inbox.applying)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, TopicPartition

from postbox.inbox.applying import TRANSIENT_BACKOFF, TRANSIENT_BACKOFF_CAP, Applier, decode
from postbox.relay.core.backoff import backoff_delay
from postbox.relay.core.db import database_unavailable, describe_error, transient_database_error
from postbox.relay.core.kafka_config import with_structlog_logger
from postbox.relay.core.sql import query

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.inbox")
# Each parked message is requeued in a transaction of its own: this many tries of it when they keep meeting
# transient database errors, then the message is left parked as it was and reported.
REQUEUE_TRIES = 5


@dataclass(frozen=True)
class Requeued:
    """What a requeue did: messages applied now, failed again (with their new reasons), and gone from
    the broker (retention or compaction took them; they stay failed)."""

    applied: list[str]
    failed_again: list[tuple[str, str]]
    gone: list[str]


def requeue(
    applier: Applier,
    conn: psycopg.Connection[tuple[Any, ...]],
    fetcher_config: dict[str, Any],
    *,
    ids: list[str] | None = None,
    error_like: str | None = None,
) -> Requeued:
    """Parked messages of the consumer's inbox read again from Kafka by their coordinates and run through
    their handlers (with the usual retries), each in a transaction of its own that also marks it done.

    A message parked because its id was unusable stays parked: without an id it cannot be applied once.
    The running consumers never touch these messages again (their offsets are past them), and the rows
    are locked while this runs, so nothing is applied twice."""
    applied: list[str] = []
    again: list[tuple[str, str]] = []
    gone: list[str] = []
    fetcher = Consumer(
        with_structlog_logger(
            {
                **fetcher_config,
                "group.id": f"postbox-requeue-{applier.inbox.consumer}",
                "enable.auto.commit": False,
                "auto.offset.reset": "error",
                "isolation.level": "read_committed",
            }
        )
    )
    try:
        with conn.transaction():
            parked = conn.execute(
                query(QUERIES, "parked_to_requeue"),
                {"consumer": applier.inbox.consumer, "ids": ids, "error_like": error_like},
            ).fetchall()
        for message_id, topic, partition, offset in parked:
            record = _fetch(fetcher, str(topic), int(partition), int(offset))
            if record is None:
                gone.append(str(message_id))
                continue
            done, reason = _requeue_retrying(applier, conn, str(message_id), record)
            if done:
                applied.append(str(message_id))
            elif reason is not None:
                again.append((str(message_id), reason))
    finally:
        fetcher.close()
    return Requeued(applied, again, gone)


def _requeue_retrying(
    applier: Applier, conn: psycopg.Connection[tuple[Any, ...]], message_id: str, record: Any
) -> tuple[bool, str | None]:
    """_requeue_one, tried again when a transient database error rolls its transaction back (the
    message is not at fault); after REQUEUE_TRIES such errors it is left parked as it was."""
    for tries in range(1, REQUEUE_TRIES + 1):
        try:
            return _requeue_one(applier, conn, message_id, record)
        except Exception as exc:
            if database_unavailable(exc, conn) or not transient_database_error(exc):
                raise
            error = describe_error(exc)
        log.warning("inbox_requeue_retry", message_id=message_id, attempt=tries, error=error)
        time.sleep(backoff_delay(tries, base=TRANSIENT_BACKOFF, cap=TRANSIENT_BACKOFF_CAP))
    return False, f"left parked as it was: {REQUEUE_TRIES} transient database errors (last: {error})"


def _requeue_one(
    applier: Applier, conn: psycopg.Connection[tuple[Any, ...]], message_id: str, record: Any
) -> tuple[bool, str | None]:
    """One parked message through its handler in a transaction of its own: (True, None) applied,
    (False, reason) parked again, (False, None) requeued meanwhile by someone else."""
    with conn.transaction():
        locked = conn.execute(
            query(QUERIES, "parked_to_requeue"),
            {"consumer": applier.inbox.consumer, "ids": [message_id], "error_like": None},
        ).fetchone()
        if locked is None:
            return False, None
        work = decode(record, applier.inbox)
        if work.missing_id is not None or work.message.message_id != message_id:
            return False, f"its id is unusable ({work.missing_id}); left parked"
        reason = applier.handle(conn, work)
        if reason is not None:
            return False, reason
        conn.execute(
            query(QUERIES, "mark_requeued_done"),
            {"consumer": applier.inbox.consumer, "message_id": message_id},
        )
    # Applied and committed: the after_commit hooks run for it, as for a message a batch applies.
    applier.inbox.run_after_commit([work.message], applier.calls)
    return True, None


def _fetch(fetcher: Consumer, topic: str, partition: int, offset: int) -> Any:
    """The record at exactly these coordinates, or None when the broker no longer has it."""
    fetcher.assign([TopicPartition(topic, partition, offset)])
    try:
        for record in fetcher.consume(1, timeout=10):
            if record.error() is None and record.offset() == offset:
                return record
        return None
    finally:
        fetcher.unassign()
