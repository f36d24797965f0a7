"""The relay's spans (only imported when tracing is on): one PRODUCER span per message handed to Kafka.

Each span is the child of the trace context the writer's transaction stored in the row (its traceparent
header), and the Kafka record carries the span's own context in its `traceparent` header, so a consumer
built for Debezium's tracing (which does the same) sees the relay's span as its parent.

One span per message rather than one per batch with a link per message: links do not join traces, so a
batch span would start a trace of its own and break the one trace from the writer to the handler that
the whole point is; and a sampled-out message costs a non-recording span only (the writer's sampling
decision carries over by the parent-based sampler). The cost of both, sampled and not, is in the README.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from relay.core.tracing import TRACE_HEADERS, carrier_of
from relay.outbox.outcome import Delivery, RowState
from relay.outbox.publisher import Ack
from relay.outbox.routing import Message, OutboxRow


class PublishSpans:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def start(self, rows: Sequence[OutboxRow], messages: Sequence[Message]) -> list[Span]:
        """A started span per message (rows[i] became messages[i]), and each message's propagation
        headers replaced by that span's context: the writer's baggage is kept, its traceparent becomes
        the span's parent."""
        propagator = propagate.get_global_textmap()
        spans = []
        for row, message in zip(rows, messages, strict=True):
            parent = propagator.extract(carrier_of(row.headers or {}))
            attributes: dict[str, str | int] = {
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": message.topic,
                "messaging.message.id": row.event_id,
                "messaging.kafka.message.key": row.aggregate_id,
                "messaging.message.body.size": len(message.value or b""),
                "postbox.outbox.row_id": row.id,
                "postbox.event_type": row.event_type,
            }
            if message.value is None:
                attributes["messaging.kafka.message.tombstone"] = True
            span = self._tracer.start_span(
                f"send {message.topic}", context=parent, kind=SpanKind.PRODUCER, attributes=attributes
            )
            carrier: dict[str, str] = {}
            propagator.inject(carrier, context=trace.set_span_in_context(span, parent))
            headers = [(name, value) for name, value in message.headers if name not in TRACE_HEADERS]
            headers.extend((name, value.encode()) for name, value in carrier.items())
            message.headers[:] = headers  # the Message is frozen, its header list is ours to fill
            spans.append(span)
        return spans

    @staticmethod
    def end(
        spans: Sequence[Span],
        deliveries: Sequence[Delivery],
        states: Sequence[RowState],
        acks: Sequence[Ack | None],
    ) -> None:
        """End each span at its message's delivery report, with where it landed; a message that was not
        delivered, or whose row is retried after all (a predecessor of its aggregate failed), says why."""
        for span, delivery, state, ack in zip(spans, deliveries, states, acks, strict=True):
            if ack is not None:
                span.set_attribute("messaging.destination.partition.id", str(ack.partition))
                span.set_attribute("messaging.kafka.offset", ack.offset)
            if state is RowState.FAILED:
                span.add_event("postbox.parked", {"reason": delivery.reason or ""})
                span.set_status(Status(StatusCode.ERROR, delivery.reason))
            elif state is RowState.PENDING:
                reason = delivery.reason or "an earlier event of its aggregate was not delivered"
                span.add_event("postbox.retry", {"reason": reason})
                if delivery.disposition is not None:
                    span.set_status(Status(StatusCode.ERROR, reason))
            span.end(end_time=ack.at_ns if ack is not None else None)
