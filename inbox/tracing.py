"""The inbox's spans (only imported when tracing is on).

Kafka consumer: a CONSUMER `process` span per record, the child of the context its headers carry (the
relay's publish span, or any W3C-propagating producer's). The handler runs with that span current, so the
application's own spans are its children. What happens to the record besides the handler running (a
duplicate skipped, a retry, a park, the batch rolled back) is a span event with the reason.

Webhooks: the receiver's SERVER span per request, whose context is stored with each event it carries;
the worker's `process` span per event is linked to it (the work happens later, in another trace, as
messaging's semantic conventions have it for work that is settled asynchronously).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer

from postbox.inbox.message import Message
from postbox.relay.core.tracing import carrier_of

Coordinates = tuple[str, int, int]


class BatchSpans:
    """The process spans of one consumed batch, one per record, by the record's coordinates."""

    def __init__(self, tracer: Tracer, messages: Sequence[Message], group: str, consumer: str) -> None:
        propagator = propagate.get_global_textmap()
        self._spans: dict[Coordinates, Span] = {}
        for message in messages:
            attributes: dict[str, str | int] = {
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": message.topic,
                "messaging.destination.partition.id": str(message.partition),
                "messaging.kafka.offset": message.offset,
                "messaging.message.id": message.message_id,
                "messaging.consumer.group.name": group,
                "postbox.inbox.consumer": consumer,
            }
            if message.key is not None:
                attributes["messaging.kafka.message.key"] = message.key_text or ""
            if message.event_type is not None:
                attributes["postbox.event_type"] = message.event_type
            self._spans[_at(message)] = tracer.start_span(
                f"process {message.topic}",
                context=propagator.extract(carrier_of(message.headers)),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
            )

    @contextmanager
    def current(self, message: Message) -> Iterator[None]:
        """The message's span as the current one while its handler runs."""
        span = self._spans.get(_at(message))
        if span is None:
            yield
            return
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield

    def event(self, message: Message, name: str, **attributes: str | int) -> None:
        span = self._spans.get(_at(message))
        if span is not None:
            span.add_event(name, attributes)

    def parked(self, message: Message, reason: str, attempts: int) -> None:
        span = self._spans.get(_at(message))
        if span is not None:
            span.add_event("postbox.parked", {"reason": reason, "attempts": attempts})
            span.set_status(Status(StatusCode.ERROR, reason))

    def end(self, error: BaseException | None = None) -> None:
        """End every span: after the batch's commit, or with the error that rolled it back (the batch is
        read again, so each record gets a second span then)."""
        for span in self._spans.values():
            if error is not None:
                reason = f"{type(error).__name__}: {error}"
                span.add_event("postbox.rolled_back", {"reason": reason})
                span.set_status(Status(StatusCode.ERROR, reason))
            span.end()


def _at(message: Message) -> Coordinates:
    return (message.topic, message.partition, message.offset)


@contextmanager
def receiving(tracer: Tracer, provider: str, headers: Mapping[str, bytes]) -> Iterator[Span]:
    """The receiver's span for one request to /webhooks/{provider}, current while it is handled (so the
    stored events take its context), the child of the context its HTTP headers carry, if any: a
    provider that sends none starts a trace."""
    span = tracer.start_span(
        f"POST /webhooks/{provider}",
        context=propagate.extract(carrier_of(headers)),
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": "POST",
            "http.route": "/webhooks/{provider}",
            "url.path": f"/webhooks/{provider}",
            "postbox.webhook.provider": provider,
        },
    )
    with trace.use_span(span, end_on_exit=True):
        yield span


def replied(span: Span, status: int, body: Mapping[str, object]) -> None:
    span.set_attribute("http.response.status_code", status)
    for key in ("accepted", "duplicates"):
        value = body.get(key)
        if isinstance(value, int):
            span.set_attribute(f"postbox.webhook.{key}", value)
    duplicates = body.get("duplicates")
    if isinstance(duplicates, int) and duplicates > 0:  # a provider's redelivery: stored once already
        span.add_event("postbox.duplicate", {"reason": "event id already received", "events": duplicates})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, str(body.get("error", ""))))


class WebhookSpan:
    """The worker's span for one event, with what became of it."""

    def __init__(self, span: Span) -> None:
        self.span = span

    def outcome(self, outcome: str, reason: str | None) -> None:
        self.span.set_attribute("postbox.webhook.outcome", outcome)
        if outcome in ("retry", "failed", "fenced"):
            name = "postbox.parked" if outcome == "failed" else f"postbox.{outcome}"
            self.span.add_event(name, {"reason": reason or ""})
            self.span.set_status(Status(StatusCode.ERROR, reason))
        elif outcome == "unhandled":
            self.span.add_event("postbox.unhandled", {"reason": reason or ""})


@contextmanager
def webhook_processing(
    tracer: Tracer, provider: str, event_id: str, event_type: str, attempt: int, headers: dict[str, str]
) -> Iterator[WebhookSpan]:
    """The worker's span for one event, current while its handler runs, linked to the receive span
    whose context was stored with the event."""
    received = trace.get_current_span(propagate.extract(carrier_of(headers))).get_span_context()
    span = tracer.start_span(
        f"process webhook {provider}",
        kind=SpanKind.CONSUMER,
        links=[Link(received)] if received.is_valid else None,
        attributes={
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": event_id,
            "postbox.webhook.provider": provider,
            "postbox.event_type": event_type,
            "postbox.webhook.attempt": attempt,
        },
    )
    with trace.use_span(span, end_on_exit=True):
        yield WebhookSpan(span)
