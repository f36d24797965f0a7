"""The relay's spans (only imported when tracing is on): one PRODUCER span per message handed to Kafka.

Each span is the child of the trace context the writer's transaction stored in the row (its traceparent
header), and the Kafka record carries the span's own context in its `traceparent` header, so a consumer
built for Debezium's tracing (which does the same) sees the relay's span as its parent.

One span per message rather than one per batch with a link per message: links do not join traces, so a
batch span would start a trace of its own and break the one trace from the writer to the handler that
the whole point is; and a sampled-out message costs a non-recording span only (the writer's sampling
decision carries over by the parent-based sampler). The cost of both, sampled and not, is in
docs/performance/tracing.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from postbox.relay.core.tracing import carrier_of
from postbox.relay.outbox.outcome import Delivery, RowState
from postbox.relay.outbox.publisher import Ack
from postbox.relay.outbox.routing import Message, OutboxRow

# The record's trace context is W3C Trace Context, what Debezium's consumers read, whatever else the
# application propagates: the writer's traceparent in the row is parsed as W3C, and the record's written as
# W3C. Baggage needs no work: the row's `baggage` header travels as a Kafka header like any other.
_W3C = TraceContextTextMapPropagator()
_NO_PARENT = Context()  # not the relay's current context: a row without a traceparent starts a trace
_REPLACED = ("traceparent", "tracestate")


def _unsampled(traceparent: str) -> bool:
    """A well-formed W3C traceparent whose sampled flag is off."""
    return len(traceparent) == 55 and traceparent[:3] == "00-" and traceparent[53:] in ("00", "02")


class PublishSpans:
    def __init__(self, tracer: Tracer, follows_parent: bool = False) -> None:
        self._tracer = tracer
        self._follows_parent = follows_parent  # the sampler records no child of an unsampled parent

    def start(self, rows: Sequence[OutboxRow], messages: Sequence[Message]) -> list[Span | None]:
        """A started span per message (rows[i] became messages[i]); each message's traceparent (the
        writer's, its parent) replaced by the span's own. None for a message whose writer did not sample
        its trace, under a parent-based sampler: such a span would record nothing, so none is made and
        the record carries the writer's traceparent as it is (the sampled flag off either way)."""
        spans: list[Span | None] = []
        for row, message in zip(rows, messages, strict=True):
            carrier = carrier_of(row.headers) if row.headers else None
            traceparent = carrier.get("traceparent") if carrier else None
            if traceparent is not None and self._follows_parent and _unsampled(traceparent):
                spans.append(None)
                continue
            parent = _W3C.extract(carrier) if carrier and traceparent is not None else _NO_PARENT
            span = self._tracer.start_span(f"send {message.topic}", context=parent, kind=SpanKind.PRODUCER)
            # Attributes only for a span that records: with a 1% sampler the other 99% stay cheap. (The
            # sampler decides without them: none of the standard samplers reads attributes.)
            if span.is_recording():
                span.set_attributes(
                    {
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
                )
                if message.value is None:
                    span.set_attribute("messaging.kafka.message.tombstone", True)
            # A sampled-out span's context goes on too (flags 00), so the consumer's parent-based sampler
            # honours the writer's decision.
            context = span.get_span_context()
            headers = [(name, value) for name, value in message.headers if name not in _REPLACED]
            flags = f"{context.trace_flags:02x}"
            traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags}"
            headers.append(("traceparent", traceparent.encode()))
            if context.trace_state:
                headers.append(("tracestate", context.trace_state.to_header().encode()))
            message.headers[:] = headers  # the Message is frozen, its header list is ours to fill
            spans.append(span)
        return spans

    @staticmethod
    def end(
        spans: Sequence[Span | None],
        deliveries: Sequence[Delivery],
        states: Sequence[RowState],
        acks: Sequence[Ack | None],
    ) -> None:
        """End each span at its message's delivery report, with where it landed; a message that was not
        delivered, or whose row is retried after all (a predecessor of its aggregate failed), says why."""
        for span, delivery, state, ack in zip(spans, deliveries, states, acks, strict=True):
            if span is None or not span.is_recording():
                continue  # nothing to record, nothing to export
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
