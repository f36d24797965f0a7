"""One trace from the writer's transaction to the consumer's handler, exported by real processes over
OTLP/HTTP to a receiver this test runs (tests.otlp decodes the real protocol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.apps.hooks import SCHEMA_SQL as HOOKS_SQL
from tests.apps.traced import SCHEMA_SQL as TRACED_SQL
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.support.database import execute_script
from tests.support.kafka import create_topic, produce_with_headers, read_topic
from tests.support.processes import InboxProcess, ReceiverProcess, RelayProcess, WorkerProcess
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until
from tests.support.webhooks import stripe_body, stripe_headers, wait_settled
from tests.waterfall import render, tree

pytestmark = pytest.mark.integration
Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def otel_env(otlp: OtlpReceiver) -> dict[str, str]:
    # A short export delay, so spans arrive while the test waits (the processes also flush at exit).
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}


def ids(traceparent: str | bytes) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent, whose sampled flag must be set (the SDK may set
    the "random trace id" flag as well: 01 or 03)."""
    text = traceparent.decode() if isinstance(traceparent, bytes) else traceparent
    version, trace_id, span_id, flags = text.split("-")
    assert version == "00"
    assert int(flags, 16) & 1, text
    return trace_id, span_id


def only(spans: list[ReceivedSpan], what: str) -> ReceivedSpan:
    assert len(spans) == 1, f"{what}: {len(spans)} spans, expected one: {spans}"
    return spans[0]


def test_one_trace_runs_from_the_writer_through_the_relay_to_the_handler_and_a_duplicate_is_an_event(
    servers: Servers, schema: str, db: Conn, otlp: OtlpReceiver
) -> None:
    execute_script(db, TRACED_SQL)
    env = otel_env(otlp)
    order = f"o-{uuid.uuid4().hex[:8]}"
    # A topic of its own: other tests publish to outbox.event.order, and this consumer reads from the start.
    topic = f"traced.{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 3)

    # The writer: its own SDK, a span around the transaction, no trace header passed by hand.
    written = subprocess.run(
        [sys.executable, "-m", "tests.apps.traced", servers.database_url, schema, order, topic],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert written.returncode == 0, written.stderr
    trace_id, writer_span_id = written.stdout.split()
    stored = db.execute("SELECT headers FROM outbox WHERE aggregate_id = %s", (order,)).fetchone()
    assert stored is not None
    assert ids(stored[0]["traceparent"]) == (trace_id, writer_span_id)
    assert stored[0]["baggage"] == "tenant=acme"

    with (
        RelayProcess(servers.database_url, servers.kafka_bootstrap, schema, env=env) as relay,
        InboxProcess(
            servers.database_url, servers.kafka_bootstrap, schema, "tests.apps.traced:inbox", [topic], env=env
        ) as consumer,
    ):
        wait_until(
            lambda: (
                db.execute("SELECT count(*) FROM traced_effects WHERE order_id = %s", (order,)).fetchone()
                == (1,)
            ),
            60,
            what="the handler's write",
        )
        record = next(
            r for r in read_topic(servers.kafka_bootstrap, topic, 1, settle=0) if r.key == order.encode()
        )
        # The same record again, as a producer retry or a rewound consumer would deliver it.
        produce_with_headers(
            servers.kafka_bootstrap,
            topic,
            record.value or b"",
            order.encode(),
            [list(record.headers.items())],
        )
        otlp.wait_for(
            "the duplicate's process span",
            lambda spans: any(s.event("postbox.duplicate") is not None for s in spans),
        )
        assert relay.terminate() == 0
        assert consumer.terminate() == 0

    in_trace = [s for s in otlp.spans if s.trace_id == trace_id]
    writer = only([s for s in in_trace if s.name == "place order"], "writer")
    publish = only([s for s in in_trace if s.name == f"send {topic}"], "publish")
    processes = sorted((s for s in in_trace if s.name == f"process {topic}"), key=lambda s: s.start_ns)
    handler = only([s for s in in_trace if s.name == "apply order"], "handler")

    assert (writer.service, publish.service, handler.service) == (
        "order-service",
        "postbox-relay",
        "postbox-inbox",
    )
    assert writer.span_id == writer_span_id
    # writer -> relay's publish span -> consumer's process span -> the handler's own span
    assert publish.parent_span_id == writer.span_id
    assert publish.kind == "PRODUCER"
    event_id = record.headers["id"].decode()
    assert publish.attributes == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": topic,
        "messaging.message.id": event_id,
        "messaging.kafka.message.key": order,
        "messaging.message.body.size": len(record.value or b""),
        "postbox.outbox.row_id": publish.attributes["postbox.outbox.row_id"],
        "postbox.event_type": "OrderPlaced",
        "messaging.destination.partition.id": str(record.partition),
        "messaging.kafka.offset": record.offset,
    }
    # The record carries the publish span's context (as Debezium's tracing does), and the writer's baggage.
    assert ids(record.headers["traceparent"]) == (trace_id, publish.span_id)
    assert record.headers["baggage"] == b"tenant=acme"

    assert len(processes) == 2, processes  # the delivery, then the duplicate
    first, duplicate = processes
    for process in processes:
        assert process.kind == "CONSUMER"
        assert process.parent_span_id == publish.span_id
        assert process.attributes["messaging.system"] == "kafka"
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.message.id"] == event_id
        assert process.attributes["messaging.destination.name"] == topic
        assert process.attributes["messaging.consumer.group.name"] == "traced"

    def coordinates(span: ReceivedSpan) -> tuple[str, int]:
        return span.attributes["messaging.destination.partition.id"], span.attributes[
            "messaging.kafka.offset"
        ]

    # The copy is a record of its own (the test's producer may pick another partition for the same key).
    assert coordinates(first) == (str(record.partition), record.offset)
    assert coordinates(duplicate) != coordinates(first)
    assert handler.parent_span_id == first.span_id
    assert first.event("postbox.duplicate") is None
    assert duplicate.event("postbox.duplicate") == {
        "reason": "message id already claimed by consumer 'traced'"
    }
    # Applied once: one handler span, one effect row.
    assert db.execute("SELECT count(*) FROM traced_effects WHERE order_id = %s", (order,)).fetchone() == (1,)
    # The picture of a trace in docs/how-to/tracing.md: each span under its parent, in order.
    drawn = [(depth, span.name, [name for name, _ in span.events]) for depth, span in tree(in_trace)]
    assert drawn == [
        (0, "place order", []),
        (1, f"send {topic}", []),
        (2, f"process {topic}", []),
        (3, "apply order", []),
        (2, f"process {topic}", ["postbox.duplicate"]),
    ]
    picture = render(in_trace)
    assert len(picture.splitlines()) == 2 + len(in_trace)
    if os.environ.get("POSTBOX_TRACE_WATERFALL"):
        Path(os.environ["POSTBOX_TRACE_WATERFALL"]).write_text(picture)


def test_a_webhook_has_a_receive_span_and_its_processing_links_to_it(
    servers: Servers, schema: str, db: Conn, otlp: OtlpReceiver
) -> None:
    execute_script(db, HOOKS_SQL)
    env = otel_env(otlp)
    caller_trace = uuid.uuid4().hex
    caller_span = uuid.uuid4().hex[:16]
    good, poison = stripe_body(), stripe_body("poison.event")
    with ReceiverProcess(servers.database_url, schema, env=env) as receiver:
        # A sender that propagates its context is the receive span's parent; Stripe sends none.
        status, _ = receiver.post(
            "stripe", good, {**stripe_headers(good), "traceparent": f"00-{caller_trace}-{caller_span}-01"}
        )
        assert status == 200
        assert receiver.post("stripe", poison, stripe_headers(poison))[0] == 200
        assert receiver.post("stripe", good, stripe_headers(good))[0] == 200  # Stripe retrying it
        assert receiver.terminate() == 0
    with WorkerProcess(servers.database_url, schema, env=env) as worker:
        wait_settled(db, 2)
        assert worker.terminate() == 0

    receives = sorted(otlp.named("POST /webhooks/stripe"), key=lambda s: s.start_ns)
    assert len(receives) == 3
    for span in receives:
        assert span.kind == "SERVER"
        assert span.service == "postbox-webhook-receiver"
        assert span.attributes["http.response.status_code"] == 200
    assert [s.attributes["postbox.webhook.accepted"] for s in receives] == [1, 1, 0]
    assert receives[2].event("postbox.duplicate") == {"reason": "event id already received", "events": 1}
    assert receives[0].event("postbox.duplicate") is None
    good_id, poison_id = json.loads(good)["id"], json.loads(poison)["id"]
    good_span = only(
        [s for s in otlp.named("process webhook stripe") if s.attributes["messaging.message.id"] == good_id],
        "the good event's processing (once, though it was received twice)",
    )
    assert good_span.kind == "CONSUMER"
    assert good_span.service == "postbox-webhook-worker"
    assert good_span.attributes["postbox.webhook.outcome"] == "done"
    # Linked to the receive span of the request that carried it, which is the caller's child.
    (link,) = good_span.links
    receive = next(s for s in otlp.named("POST /webhooks/stripe") if (s.trace_id, s.span_id) == link)
    assert (receive.trace_id, receive.parent_span_id) == (caller_trace, caller_span)
    stored = db.execute("SELECT headers FROM webhook_inbox WHERE event_id = %s", (good_id,)).fetchone()
    assert stored is not None
    assert ids(stored[0]["traceparent"]) == (receive.trace_id, receive.span_id)

    # The poison event: every attempt is a span, the failures are events with the reason, the last parks.
    attempts = sorted(
        (
            s
            for s in otlp.named("process webhook stripe")
            if s.attributes["messaging.message.id"] == poison_id
        ),
        key=lambda s: s.attributes["postbox.webhook.attempt"],
    )
    assert [s.attributes["postbox.webhook.outcome"] for s in attempts] == ["retry", "retry", "failed"]
    assert all(s.status == 2 for s in attempts)
    assert attempts[0].event("postbox.retry") == {"reason": "RuntimeError: cannot be applied"}
    assert attempts[-1].event("postbox.parked") == {"reason": "RuntimeError: cannot be applied"}
