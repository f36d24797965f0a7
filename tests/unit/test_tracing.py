"""Tracing's pure parts: which OTEL_* settings turn it on (and which are refused), what the writer's
enqueue stores, and the relay's publish spans, with an in-memory span exporter in place of OTLP (the
end-to-end trace over real servers and the real protocol is tests/integration/test_tracing.py)."""

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from postbox.relay.core.tracing import (
    DEFAULT_ENDPOINT,
    TracingConfigError,
    carrier_of,
    current_trace_context,
    plan_tracing,
    with_trace_context,
)
from postbox.relay.outbox.enqueue import OutboxEvent
from postbox.relay.outbox.outcome import DELIVERED, Delivery, Disposition, RowState
from postbox.relay.outbox.publisher import Ack
from postbox.relay.outbox.routing import OutboxRow, to_message
from postbox.relay.outbox.tracing import PublishSpans
from tests.support.repo import REPO

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def test_tracing_is_off_unless_the_environment_names_an_exporter() -> None:
    assert plan_tracing("relay", {}).describe() == [
        "  tracing: off (no OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER=otlp)"
    ]
    plan = plan_tracing("relay", ENDPOINT)
    assert (plan.enabled, plan.endpoint, plan.service_name) == (
        True,
        "http://collector:4318/v1/traces",
        "postbox-relay",
    )
    assert plan.describe() == [
        "  tracing: on, OTLP/HTTP to http://collector:4318/v1/traces",
        "  tracing service.name = postbox-relay",
        "  tracing sampler = parentbased_always_on",
    ]


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, "OTEL_SDK_DISABLED=true"),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, "OTEL_TRACES_EXPORTER=none"),
    ],
)
def test_the_standard_switches_turn_it_off(environ: dict[str, str], reason: str) -> None:
    plan = plan_tracing("inbox", environ)
    assert (plan.enabled, plan.reason) == (False, reason)


@pytest.mark.parametrize(
    ("environ", "endpoint"),
    [
        ({"OTEL_TRACES_EXPORTER": "otlp"}, DEFAULT_ENDPOINT),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            {**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://tempo.example/otlp/v1/traces"},
            "https://tempo.example/otlp/v1/traces",
        ),
    ],
)
def test_the_endpoint_follows_the_specification(environ: dict[str, str], endpoint: str) -> None:
    # The SDK's own rule: the signal-specific variable is used as is, the general one gets /v1/traces.
    assert plan_tracing("relay", environ).endpoint == endpoint


def test_each_daemon_has_its_own_service_name_unless_one_is_given() -> None:
    names = {
        service: plan_tracing(service, ENDPOINT).service_name
        for service in ("relay", "inbox", "webhook-worker", "receiver")
    }
    assert names == {
        "relay": "postbox-relay",
        "inbox": "postbox-inbox",
        "webhook-worker": "postbox-webhook-worker",
        "receiver": "postbox-webhook-receiver",
    }
    assert plan_tracing("inbox", {**ENDPOINT, "OTEL_SERVICE_NAME": "billing"}).service_name == "billing"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, r"^OTEL_TRACES_SAMPLER='sometimes': use one of always_on"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "nan"},
            r"^OTEL_TRACES_SAMPLER_ARG='nan': a ratio from 0 to 1",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            r"^OTEL_TRACES_SAMPLER_ARG='2'",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1%"},
            r"^OTEL_TRACES_SAMPLER_ARG='1%'",
        ),
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, r"^OTEL_TRACES_EXPORTER='jaeger': postbox exports with otlp"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, r"^OTEL_EXPORTER_OTLP_PROTOCOL='grpc'.*port \(4318\)"),
    ],
)
def test_what_postbox_cannot_honour_is_refused_naming_the_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(TracingConfigError, match=message):
        plan_tracing("relay", {**ENDPOINT, **environ})


def test_the_sampler_ratio_is_parsed() -> None:
    environ = {
        **ENDPOINT,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    plan = plan_tracing("relay", environ)
    assert (plan.sampler, plan.sampler_arg) == ("parentbased_traceidratio", 0.01)
    assert plan.describe()[2] == "  tracing sampler = parentbased_traceidratio (0.01)"


def test_asking_for_tracing_without_the_sdk_is_an_error_not_a_silent_no() -> None:
    with pytest.raises(TracingConfigError, match=r"pip install 'postbox\[otel\]'"):
        plan_tracing("relay", ENDPOINT, installed=lambda: False)
    assert not plan_tracing("relay", {}, installed=lambda: False).enabled


@pytest.fixture
def exported() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    # A provider of the test's own, not the global one: nothing here changes process-wide state.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def _stored_headers(event: OutboxEvent) -> dict[str, str]:
    """The headers column enqueue, enqueue_many and their async twins write for `event`: every one of them
    builds its rows with relay.outbox.enqueue._rows (no database needed to check what goes into the row;
    tests/integration writes real ones)."""
    from postbox.relay.outbox.enqueue import _rows  # noqa: PLC0415

    [row] = _rows([event], None)
    return json.loads(row[6])  # type: ignore[no-any-return]


def test_enqueue_stores_the_callers_trace_context_without_being_asked(
    exported: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = exported
    event = OutboxEvent("order", "o1", "OrderPlaced", {"n": 1}, headers={"h": "v"})
    assert "traceparent" not in _stored_headers(event)  # no active span: the row is as before
    with tracer.start_as_current_span("place order") as span:
        token = context.attach(baggage.set_baggage("tenant", "acme"))
        try:
            headers = _stored_headers(event)
        finally:
            context.detach(token)
    ids = span.get_span_context()
    assert headers["traceparent"].split("-")[1:3] == [f"{ids.trace_id:032x}", f"{ids.span_id:016x}"]
    assert headers["baggage"] == "tenant=acme"
    assert headers["h"] == "v"


def test_a_traceparent_the_writer_sets_itself_is_kept(
    exported: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = exported
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("place order"):
        headers = _stored_headers(OutboxEvent("order", "o1", "E", {}, headers={"traceparent": own}))
    assert headers == {"traceparent": own}
    assert with_trace_context({"baggage": "a=1"}, {"traceparent": "x", "baggage": "b=2"}) == {
        "traceparent": "x",
        "baggage": "a=1",
    }


def test_without_an_active_span_there_is_no_context() -> None:
    assert current_trace_context() == {}


def _row(row_id: int, headers: dict[str, object] | None) -> OutboxRow:
    return OutboxRow(row_id, f"evt-{row_id}", "order", "o1", "OrderPlaced", "{}", None, headers, None, 0)


def test_the_relay_sends_each_message_in_a_child_span_of_the_writer_and_passes_its_own_on(
    exported: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = exported
    writer = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    rows = [_row(1, {"traceparent": writer, "baggage": "tenant=acme"}), _row(2, None), _row(3, None)]
    rows[1] = rows[1]._replace(payload=None)  # a tombstone
    messages = [to_message(row, "outbox.event.order") for row in rows]
    spans = PublishSpans(tracer).start(rows, messages)
    acks = [Ack(4, 1234, 1_000_000_000), None, None]
    deliveries = [DELIVERED, Delivery(Disposition.PARK, "too large"), Delivery(None)]
    PublishSpans.end(spans, deliveries, [RowState.PUBLISHED, RowState.FAILED, RowState.PENDING], acks)

    first, second, third = sorted(
        exporter.get_finished_spans(), key=lambda s: s.attributes["postbox.outbox.row_id"]
    )  # type: ignore[index]
    assert first.name == "send outbox.event.order"
    assert first.kind is SpanKind.PRODUCER
    assert first.context is not None
    assert first.parent is not None
    assert f"{first.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{first.parent.span_id:016x}" == "b7ad6b7169203331"
    assert dict(first.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "outbox.event.order",
        "messaging.message.id": "evt-1",
        "messaging.kafka.message.key": "o1",
        "messaging.message.body.size": 2,
        "postbox.outbox.row_id": 1,
        "postbox.event_type": "OrderPlaced",
        "messaging.destination.partition.id": "4",
        "messaging.kafka.offset": 1234,
    }
    assert first.end_time == 1_000_000_000  # at the broker's acknowledgement, not when the batch ended
    # The record carries the span's own context (one traceparent, not the writer's) and the baggage.
    carrier = carrier_of(dict(messages[0].headers))
    assert carrier["traceparent"] == f"00-{first.context.trace_id:032x}-{first.context.span_id:016x}-01"
    assert carrier["baggage"] == "tenant=acme"
    assert [name for name, _ in messages[0].headers].count("traceparent") == 1
    assert ("id", b"evt-1") in messages[0].headers

    assert second.parent is None  # a row written outside any trace starts one
    assert second.attributes is not None
    assert second.attributes["messaging.kafka.message.tombstone"] is True
    assert second.status.status_code is StatusCode.ERROR
    assert [(e.name, dict(e.attributes or {})) for e in second.events] == [
        ("postbox.parked", {"reason": "too large"})
    ]
    assert [e.name for e in third.events] == ["postbox.retry"]
    assert third.status.status_code is StatusCode.UNSET  # held back behind its aggregate, not failed itself


def test_an_invalid_otel_setting_fails_config_check_and_the_daemons_start() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "POSTBOX_DATABASE_URL": "postgresql://nohost/x",
        "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    }

    def postbox(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "postbox", *args]
        return subprocess.run(
            command, capture_output=True, text=True, cwd=REPO, env={**env, **extra}, check=False
        )

    good = postbox("config", "check", "--service", "relay")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "  tracing: on, OTLP/HTTP to http://collector:4318/v1/traces" in good.stdout
    bad = postbox("config", "check", "--service", "relay", OTEL_TRACES_SAMPLER="sometimes")
    assert bad.returncode == 1
    assert "relay: INVALID: OTEL_TRACES_SAMPLER='sometimes'" in bad.stdout
    started = postbox("relay", "run", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    assert started.returncode == 2
    assert "postbox relay run: error: OTEL_EXPORTER_OTLP_PROTOCOL='grpc'" in started.stderr


@pytest.mark.parametrize("follows_parent", [False, True])
def test_a_message_the_writer_did_not_sample_records_nothing_and_keeps_its_trace(
    exported: tuple[trace.Tracer, InMemorySpanExporter], follows_parent: bool
) -> None:
    tracer, exporter = exported  # parent-based sampling, the SDK's default: the writer's flag decides
    writer = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    sampled = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"
    rows = [_row(1, {"traceparent": writer}), _row(2, {"traceparent": sampled})]
    messages = [to_message(row, "outbox.event.order") for row in rows]
    spans = PublishSpans(tracer, follows_parent).start(rows, messages)
    PublishSpans.end(spans, [DELIVERED] * 2, [RowState.PUBLISHED] * 2, [Ack(0, 1, 1), Ack(0, 2, 2)])
    (recorded,) = exporter.get_finished_spans()  # only the sampled writer's message has a span
    assert recorded.attributes is not None
    assert recorded.attributes["postbox.outbox.row_id"] == 2
    traceparent = carrier_of(dict(messages[0].headers))["traceparent"]
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "00")
    if follows_parent:  # no span made at all: the writer's context goes on as it is
        assert spans[0] is None
        assert traceparent == writer
    else:  # the SDK's unrecorded span, with an id of its own
        assert span_id != "b7ad6b7169203331"
