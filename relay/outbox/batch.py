"""A batch between its read and its mark: the page's records prepared into messages (InFlight holds it
while the producer has them), every row's fate known before sending where it can be.

Preparing is one guarded step per row: whatever a writer stored, an exception while turning the row
into a message parks that row alone, with a reason that quotes none of its contents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.held import HeldAggregates
from postbox.relay.outbox.outcome import Delivery
from postbox.relay.outbox.routing import (
    Message,
    OutboxRow,
    RoutingError,
    TopicRoutes,
    load_headers,
    raised_in,
    to_message,
    unpreparable_reason,
)
from postbox.relay.outbox.sources.base import Connection, OutboxRecord, Page

if TYPE_CHECKING:
    from postbox.relay.outbox.delivery import SentBatch
    from postbox.relay.outbox.tracing import PublishSpans

log = structlog.get_logger("postbox.relay")
# The topic label of a row whose topic is no legal name: a writer's arbitrary text is no metric label.
UNROUTABLE = "(unroutable)"
HELD_IN_SHARD = Delivery(Disposition.RETRY, "held back behind an earlier row of its shard (read past)")


@dataclass
class InFlight:
    """A claimed batch whose messages are with the producer; its transaction stays open until the mark."""

    conn: Connection
    lane: list[int]
    rows: list[OutboxRow]
    topics: list[str]
    deliveries: list[Delivery | None]  # known before sending: blocked topics, rows that cannot be routed
    sent: list[int]  # indexes into rows of the messages handed to the producer
    delivery: SentBatch  # its messages with the producer, as the relay's delivery guarantee sends them
    started: float
    page: Page  # where the rows came from, and how their outcomes are written back
    full: bool  # the read took as many rows as it could, or the byte budget cut it: rows may be waiting
    # Wall-clock times (time.time()) of its stages, for the stage metrics and the latency breakdown:
    # the wake-up it began after (a NOTIFY, a poll, or the previous batch), and the end of its claim.
    woke_at: float = 0.0
    claimed_at: float = 0.0
    claim_seconds: float = 0.0
    spans: list[Any] | None = None  # one publish span per message sent, when tracing is on


@dataclass
class Prepared:
    """A page's rows, each row's topic, what is known of each row before sending (None for a row to
    send), and the messages to send with their rows' indexes (`sent`)."""

    rows: list[OutboxRow]
    topics: list[str]
    deliveries: list[Delivery | None]
    sent: list[int]
    messages: list[Message]


@dataclass
class Preparer:
    """Turns a page's records into messages. `check_topic`: a topic's verdict (None when it takes
    messages; it may wait for the broker's metadata). `held`: aggregates waiting for a blocked topic."""

    routes: TopicRoutes
    type_header: str
    held: HeldAggregates
    check_topic: Callable[[str], Delivery | None]
    spans: PublishSpans | None = None

    def prepare(self, records: list[OutboxRecord], read_past: bool, max_message: int) -> Prepared:
        """The page's records prepared: parked, held back, for a blocked topic, or to send.
        `read_past`: the page's (see Page.read_past)."""
        routes, type_header = self.routes, self.type_header
        held = self.held
        rows: list[OutboxRow] = []
        topics: list[str] = []
        deliveries: list[Delivery | None] = []  # known before sending: why a row is not sent
        sent: list[int] = []
        messages: list[Message] = []
        # One verdict per distinct topic per batch: a metadata check can wait, and it runs inside the
        # batch transaction.
        verdicts: dict[str, Delivery | None] = {}
        # A page read past: a shard's cursor cannot pass a row held back before sending, so its later rows
        # in this page are not sent either (they would be read and sent again with it).
        held_shards: set[int] = set()
        for index, record in enumerate(records):
            # The row's preparation, one guarded step: whatever a writer stored, any exception while
            # turning the row into a message (headers, size, routing, templating, encoding) parks this row
            # alone, with a reason that quotes none of its contents. The record is the claim's: its
            # headers are still JSON text (loaded here, not by the fetch).
            try:
                headers = record.headers
                row = record.row(None if headers is None else load_headers(headers))
                if row.size > max_message:  # its payload was never loaded (see claim_batch)
                    raise RoutingError(
                        f"message too large: {row.size} bytes, over the producer's message.max.bytes "
                        f"({max_message}); not loaded"
                    )
                topic = routes.topic(row)
                message = to_message(row, topic, type_header)
            except Exception as exc:  # noqa: BLE001 - the row is parked whatever it raised
                row = record.row(None)
                rows.append(row)
                topics.append(UNROUTABLE)
                deliveries.append(unpreparable(row, exc))
                continue
            rows.append(row)
            topics.append(topic)
            if read_past:
                # A page read past holds an aggregate, not its shard, while its events wait for a topic.
                waits = held.waits_for(row.shard, row.aggregate_id)
                if waits is not None:
                    deliveries.append(Delivery(Disposition.HOLD, held_behind(waits), waits))
                    continue
            if row.shard in held_shards:
                deliveries.append(HELD_IN_SHARD)
                continue
            if topic not in verdicts:
                verdicts[topic] = self.check_topic(topic)
            gate = verdicts[topic]
            if gate is not None and read_past and gate.disposition is Disposition.TOPIC_BLOCKED:
                held.hold(row.shard, row.aggregate_id, topic)
                deliveries.append(Delivery(Disposition.HOLD, f"held: {gate.reason}", topic))
                continue
            deliveries.append(gate)
            if gate is not None:
                if read_past:
                    held_shards.add(row.shard)
                continue
            messages.append(message)
            sent.append(index)
        return Prepared(rows, topics, deliveries, sent, messages)

    def start_spans(self, prepared: Prepared) -> list[Any]:
        """A publish span per message (tracing on), the last part of a row's preparation: it needs the
        topic's verdict, so it runs after the batch's guarded step, under the same rule (a row whose span
        cannot be started is parked and not sent). `prepared.sent` and `.messages` are trimmed to the
        messages whose span started."""
        assert self.spans is not None
        rows, deliveries = prepared.rows, prepared.deliveries
        spans: list[Any] = []
        kept: list[Message] = []
        kept_rows: list[int] = []
        for index, message in zip(prepared.sent, prepared.messages, strict=True):
            try:
                spans.append(self.spans.start((rows[index],), (message,))[0])
            except Exception as exc:  # noqa: BLE001 - the row is parked whatever it raised
                deliveries[index] = unpreparable(rows[index], exc)
                continue
            kept.append(message)
            kept_rows.append(index)
        prepared.sent, prepared.messages = kept_rows, kept
        return spans


def unpreparable(row: OutboxRow, exc: Exception) -> Delivery:
    """The fate of a row whose preparation raised `exc`: parked. An exception other than a RoutingError (the
    expected kind, whose reason says it all) is logged by its class and where it was raised, never its
    message, which may quote the row's contents."""
    if not isinstance(exc, RoutingError):
        log.warning("relay_row_unpreparable", row_id=row.id, error=type(exc).__name__, where=raised_in(exc))
    return Delivery(Disposition.PARK, unpreparable_reason(exc))


def held_behind(topic: str) -> str:
    return f"held behind an earlier event of its aggregate, which waits for topic {topic}"
