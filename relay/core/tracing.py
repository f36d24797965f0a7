"""OpenTelemetry tracing: optional (`pip install 'postbox[otel]'`), configured by the standard OTEL_*
variables only.

Tracing is on when the OpenTelemetry SDK is installed, OTEL_SDK_DISABLED is not true, and the environment
asks for an exporter: OTEL_TRACES_EXPORTER=otlp, or an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Unlike the SDK's auto-instrumentation, postbox does not send to
localhost:4318 just because the SDK is present: a daemon exports only where it is told to.

`plan_tracing` decides from the environment and does no I/O (what `postbox config check` prints);
`start_tracing` builds the SDK's provider for a daemon's main(); `current_trace_context` is the writer's
side: what `enqueue` adds to a row's headers.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from postbox.relay.core.settings import SettingsError

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# The service.name each daemon reports unless OTEL_SERVICE_NAME says otherwise.
DEFAULT_SERVICE_NAMES = {
    "relay": "postbox-relay",
    "inbox": "postbox-inbox",
    "webhook-worker": "postbox-webhook-worker",
    "receiver": "postbox-webhook-receiver",
}
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")  # what W3C propagation reads and writes


class TracingConfigError(SettingsError):
    """The OTEL_* variables ask for something postbox cannot do; the message names the variable."""


@dataclass(frozen=True)
class TracingPlan:
    enabled: bool
    reason: str  # why it is off, or "" when on
    service_name: str
    endpoint: str
    sampler: str
    sampler_arg: float | None

    def describe(self) -> list[str]:
        """`postbox config check`'s lines for tracing."""
        if not self.enabled:
            return [f"  tracing: off ({self.reason})"]
        sampler = self.sampler + (f" ({self.sampler_arg})" if self.sampler_arg is not None else "")
        return [
            f"  tracing: on, OTLP/HTTP to {self.endpoint}",
            f"  tracing service.name = {self.service_name}",
            f"  tracing sampler = {sampler}",
        ]


def sdk_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ImportError:  # a parent package that is there but cannot be imported
        return False


def plan_tracing(
    service: str, environ: Mapping[str, str], *, installed: Callable[[], bool] = sdk_installed
) -> TracingPlan:
    """What tracing a daemon of `service` (a key of DEFAULT_SERVICE_NAMES) would run with. Pure but for
    looking whether the SDK is installed. TracingConfigError for values postbox cannot honour."""

    def get(name: str) -> str:
        return environ.get(name, "").strip()

    service_name = get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAMES[service]
    sampler = (get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").lower()
    if sampler not in SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={sampler!r}: use one of {', '.join(SAMPLERS)}")
    sampler_arg: float | None = None
    if sampler.endswith("traceidratio"):
        raw = get("OTEL_TRACES_SAMPLER_ARG") or "1.0"
        try:
            sampler_arg = float(raw)
        except ValueError:
            sampler_arg = -1.0
        if not 0.0 <= sampler_arg <= 1.0:  # also false for NaN
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: a ratio from 0 to 1")
    exporter = get("OTEL_TRACES_EXPORTER").lower()
    if exporter not in ("", "otlp", "none"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: postbox exports with otlp (or none)")
    protocol = (get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or get("OTEL_EXPORTER_OTLP_PROTOCOL")).lower()
    if protocol not in ("", "http/protobuf"):
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: postbox exports OTLP over HTTP (http/protobuf); "
            "point it at the collector's HTTP port (4318)"
        )
    endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = get("OTEL_EXPORTER_OTLP_ENDPOINT").rstrip("/") + "/v1/traces"

    def off(reason: str) -> TracingPlan:
        return TracingPlan(False, reason, service_name, endpoint or DEFAULT_ENDPOINT, sampler, sampler_arg)

    if get("OTEL_SDK_DISABLED").lower() == "true":
        return off("OTEL_SDK_DISABLED=true")
    if exporter == "none":
        return off("OTEL_TRACES_EXPORTER=none")
    if exporter != "otlp" and not endpoint:
        return off("no OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER=otlp")
    if not installed():
        # Asked for, and impossible: say so rather than run untraced in silence.
        raise TracingConfigError(
            "OTEL_EXPORTER_OTLP_ENDPOINT/OTEL_TRACES_EXPORTER ask for tracing, but the OpenTelemetry SDK "
            "is not installed: pip install 'postbox[otel]'"
        )
    return TracingPlan(True, "", service_name, endpoint or DEFAULT_ENDPOINT, sampler, sampler_arg)


@dataclass
class Tracing:
    """A daemon's tracer (None when tracing is off); leaving the `with` block exports what is queued."""

    tracer: Tracer | None
    shutdown: Callable[[], None]
    # The sampler is one of the parentbased_* (the default): a span whose remote parent was not sampled
    # is never recorded, so a daemon may skip making it (the relay does, for messages whose writer did
    # not sample its trace). False when unknown (an application's own provider).
    follows_parent: bool = False

    def __enter__(self) -> Tracing:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()


TRACING_OFF = Tracing(None, lambda: None)


def start_tracing(plan: TracingPlan) -> Tracing:
    """The SDK's tracer provider for `plan` (TRACING_OFF when tracing is off), installed as the global
    one so the application's own spans (a handler's) land in the same traces. When the embedding
    application has installed an SDK provider already, postbox uses that one and leaves its shutdown to
    the application."""
    if not plan.enabled:
        return TRACING_OFF
    from opentelemetry import trace  # noqa: PLC0415  (optional dependency)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return Tracing(current.get_tracer("postbox"), lambda: None)
    # The sampler, the exporter's endpoint, headers, timeout and compression come from the same OTEL_*
    # variables plan_tracing checked; the SDK reads them itself.
    provider = TracerProvider(resource=Resource.create({"service.name": plan.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return Tracing(provider.get_tracer("postbox"), provider.shutdown, plan.sampler.startswith("parentbased"))


def start_tracing_for(service: str, environ: Mapping[str, str]) -> Tracing:
    """plan_tracing then start_tracing: what each daemon's main() calls (TracingConfigError as there)."""
    return start_tracing(plan_tracing(service, environ))


def start_daemon_tracing(service: str, parser: argparse.ArgumentParser) -> Tracing:
    """What each daemon's main() calls: tracing from the process's OTEL_* variables; a value postbox
    cannot honour ends the start as a usage error (exit 2) naming the variable, before any work."""
    try:
        return start_tracing(plan_tracing(service, os.environ))
    except TracingConfigError as exc:
        parser.error(str(exc))


_inject: Callable[[dict[str, str]], None] | None = None


def _injector() -> Callable[[dict[str, str]], None]:
    global _inject  # noqa: PLW0603  (looked up once: importing OpenTelemetry's API is not free)
    if _inject is None:
        try:
            from opentelemetry import propagate  # noqa: PLC0415
        except ImportError:
            _inject = _nothing
        else:
            _inject = propagate.inject
    return _inject


def _nothing(_carrier: dict[str, str]) -> None:
    return None


def current_trace_context() -> dict[str, str]:
    """The caller's current trace context as W3C headers (traceparent, tracestate, and baggage when set),
    by the globally configured propagators; empty with no active span or without OpenTelemetry's API."""
    carrier: dict[str, str] = {}
    _injector()(carrier)
    return carrier


def with_trace_context(headers: Mapping[str, str], context: Mapping[str, str]) -> Mapping[str, str]:
    """A row's headers with `context` (from current_trace_context) added, unless the writer set its own
    traceparent; a header the writer gave (its own baggage) wins."""
    if not context or "traceparent" in headers:
        return headers
    return {**context, **headers}


def carrier_of(headers: Mapping[str, Any]) -> dict[str, str]:
    """The W3C propagation headers of a message's headers (str or bytes values), as a text carrier."""
    carrier: dict[str, str] = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str):
            carrier[name] = value
    return carrier
