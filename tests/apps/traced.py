"""A traced order service and its downstream, for the tracing test.

`python -m tests.apps.traced DATABASE_URL SCHEMA ORDER_ID TOPIC` is the writer: an application with its own
OpenTelemetry SDK setup (as a service would have), which places an order inside a span, with baggage,
and enqueues its event in the same transaction without passing any trace header itself. It prints the
span's trace id and span id.

`tests.apps.traced:inbox` is the downstream consumer: its handler opens a span of its own, which must
land in the same trace, as the child of postbox's process span.
"""

from __future__ import annotations

import sys
from typing import Any

from opentelemetry import baggage, context, trace

from postbox.inbox import Inbox, Message

inbox = Inbox("traced")

SCHEMA_SQL = "CREATE TABLE IF NOT EXISTS traced_effects (message_id text NOT NULL, order_id text)"


@inbox.handler("OrderPlaced")
def apply(tx: Any, message: Message) -> None:
    with trace.get_tracer("tests.apps.traced").start_as_current_span("apply order") as span:
        span.set_attribute("order.id", message.payload["order"])
        tx.execute(
            "INSERT INTO traced_effects VALUES (%s, %s)", (message.message_id, message.payload["order"])
        )


def main(database_url: str, schema: str, order_id: str, topic: str) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    from postbox.relay.core.db import connect  # noqa: PLC0415
    from postbox.relay.outbox.enqueue import enqueue  # noqa: PLC0415

    provider = TracerProvider(resource=Resource.create({"service.name": "order-service"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    tracer = provider.get_tracer("order-service")
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with tracer.start_as_current_span("place order") as span, connect(database_url, schema) as conn:
            with conn.transaction():
                payload = {"order": order_id}
                enqueue(conn, "order", order_id, "OrderPlaced", payload, topic=topic, schema=schema)
            ids = span.get_span_context()
            print(f"{ids.trace_id:032x} {ids.span_id:016x}", flush=True)
    finally:
        context.detach(token)
    provider.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
