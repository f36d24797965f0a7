"""The relay's per-row guard and the settings that would reach a formatter, without servers: a batch's
records with hostile values go through Preparer.prepare (the guarded step) and come out parked one by one,
the rest sent in order; settings that would hand a row to a formatter or name an unusable schema are
refused at start, naming the setting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from postbox.relay.core.sql import check_schema_name, name_for_parameters, schema_name_problem
from postbox.relay.outbox import batch as batch_module
from postbox.relay.outbox.batch import UNROUTABLE, Prepared, Preparer
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.held import HeldAggregates
from postbox.relay.outbox.routing import Message, OutboxRow, TopicRoutes
from postbox.relay.outbox.settings import MigrateSettings, PruneSettings, RelaySettings, SettingsError
from postbox.relay.outbox.sources.base import OutboxRecord


def settings(**overrides: Any) -> RelaySettings:
    return RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", **overrides)


def preparer(spans: Any = None) -> Preparer:
    """Every topic usable (nothing is sent: preparing does not send)."""
    given = settings()
    return Preparer(
        TopicRoutes(given.topic_template),
        given.event_type_header,
        HeldAggregates(),
        lambda _topic: None,
        spans,
    )


def record(row_id: int, headers: str | None = None, **fields: Any) -> OutboxRecord:
    """A record as a read returns it: the row's columns (headers as JSON text), then claimed_rows."""
    values: dict[str, Any] = {
        "id": row_id,
        "event_id": f"00000000-0000-0000-0000-{row_id:012d}",
        "aggregate_type": "order",
        "aggregate_id": f"o-{row_id % 2}",
        "event_type": "Placed",
        "payload": "{}",
        "payload_bytes": None,
        "headers": headers,
        "topic": None,
        "shard": 3,
        "created_epoch": 0.0,
        "size": 100,
    }
    values.update(fields)
    return OutboxRecord(**values, claimed_rows=99)


def prepare(records: Sequence[OutboxRecord], spans: Any = None) -> Prepared:
    return preparer(spans).prepare(list(records), False, 1_000_000)


def test_rows_whose_preparation_raises_are_parked_one_by_one_and_the_rest_sent_in_order() -> None:
    records = [
        record(1),
        record(2, '{"n": 1' + "0" * 5000 + "}"),  # ValueError when loaded
        record(3, '{"traceparent": "00-ab-cd-01"}'),
        record(4, '{"n": ' + "[" * 5000 + "]" * 5000 + "}"),  # RecursionError when loaded
        record(5, "[1]"),  # an array (only if the headers constraint was dropped)
        record(6, '{"n": 1}'),  # a header that is not a string: a RoutingError, as before
        record(7, aggregate_type=""),  # nothing to route by
        record(8, size=5_000_000),  # over message.max.bytes: never loaded
        record(9),
    ]
    prepared = prepare(records)
    rows, topics, deliveries = prepared.rows, prepared.topics, prepared.deliveries
    sent, messages = prepared.sent, prepared.messages
    assert [r.id for r in rows] == list(range(1, 10)), "one row per record, in order"
    assert sent == [0, 2, 8]
    assert [m.headers[0][1] for m in messages] == [r.event_id.encode() for r in (rows[0], rows[2], rows[8])]
    assert rows[2].headers == {"traceparent": "00-ab-cd-01"}, "headers loaded for the rows sent"
    parked = {rows[i].id: d.reason for i, d in enumerate(deliveries) if d is not None}
    assert all(d.disposition is Disposition.PARK for d in deliveries if d is not None)
    assert parked[2] == "the row could not be made into a message: ValueError in load_headers"
    assert parked[4] == "the row could not be made into a message: RecursionError in load_headers"
    assert parked[5] == "headers are not a JSON object"
    assert parked[6] == "header 'n' is not a string"
    assert "aggregate_type is empty" in str(parked[7])
    assert "message.max.bytes" in str(parked[8])
    assert [topics[i] for i in (1, 3, 4, 5, 6, 7)] == [UNROUTABLE] * 6, "no writer's text as a metric label"


def test_any_exception_in_a_rows_preparation_parks_it_by_class_and_logs_where(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard is not a list of known errors: a bug that raises anything for one row parks that row."""
    real = batch_module.to_message

    def to_message(row: OutboxRow, topic: str, type_header: str | None = None) -> Message:
        if row.aggregate_id == "boom":
            {}[row.payload]  # a KeyError whose message would quote the payload
        return real(row, topic, type_header)

    monkeypatch.setattr(batch_module, "to_message", to_message)
    records = [record(1), record(2, aggregate_id="boom", payload='"secret payload text"'), record(3)]
    prepared = prepare(records)
    assert prepared.sent == [0, 2]
    parked = prepared.deliveries[1]
    assert parked is not None
    assert parked.disposition is Disposition.PARK
    # Where: the innermost frame in the relay package (the fake to_message is not in it).
    assert parked.reason == "the row could not be made into a message: KeyError in prepare"
    logged = capsys.readouterr().out
    assert "relay_row_unpreparable" in logged
    assert "KeyError" in logged
    assert "secret payload text" not in logged


class FailingSpans:
    """PublishSpans whose start raises for one row's message."""

    def __init__(self, failing_id: int) -> None:
        self.failing_id = failing_id

    def start(self, rows: Sequence[OutboxRow], messages: Sequence[Message]) -> list[object]:
        if rows[0].id == self.failing_id:
            raise TypeError("an attribute value the span refused")
        return [object() for _ in rows]


def test_a_row_whose_span_cannot_be_started_is_parked_and_not_sent() -> None:
    spans_maker = FailingSpans(2)
    prepared = prepare([record(1), record(2), record(3)], spans_maker)
    spans = preparer(spans_maker).start_spans(prepared)
    rows, kept = prepared.rows, prepared.messages
    assert prepared.sent == [0, 2]
    assert len(spans) == len(kept) == 2
    assert [m.headers[0][1] for m in kept] == [rows[0].event_id.encode(), rows[2].event_id.encode()]
    parked = prepared.deliveries[1]
    assert parked is not None
    assert parked.disposition is Disposition.PARK
    assert parked.reason == "the row could not be made into a message: TypeError in start_spans"


# -- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template", ["outbox.{aggregate_type:>99999999}", "{aggregate_type!r}", "x.{aggregate_type:d}", "a b"]
)
def test_a_topic_template_that_would_reach_a_formatter_is_refused_naming_the_setting(template: str) -> None:
    with pytest.raises(SettingsError, match=r"^--topic-template \(POSTBOX_RELAY_TOPIC_TEMPLATE\): "):
        settings(topic_template=template)


@pytest.mark.parametrize("header", ["id", "type\x00"])
def test_an_event_type_header_that_would_forge_the_event_id_is_refused(header: str) -> None:
    with pytest.raises(SettingsError, match=r"^--event-type-header \(POSTBOX_RELAY_EVENT_TYPE_HEADER\): "):
        settings(event_type_header=header)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ("", "is empty"),
        ("a\x00b", "NUL"),
        ("$user", "session user's own schema"),
        ("pg_outbox", "reserves for its system schemas"),
    ],
)
def test_a_schema_postbox_cannot_use_is_refused_by_every_relay_command(schema: str, problem: str) -> None:
    assert problem in str(schema_name_problem(schema))
    with pytest.raises(ValueError, match=problem):
        check_schema_name(schema)
    for build in (
        lambda: RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", schema=schema),
        lambda: MigrateSettings(database_url="postgresql://x", schema=schema),
        lambda: PruneSettings(database_url="postgresql://x", schema=schema),
    ):
        with pytest.raises(SettingsError, match=r"^--schema \(POSTBOX_SCHEMA\): "):
            build()


@pytest.mark.parametrize(
    "schema",
    [
        'a"b',
        "My-Schema",
        "with space",
        "ünïcode",
        "50%off",
        "a%sb",
        "a.b",
        "it's",
        "$dollar",
        "x" * 70,
        "a,b",
    ],
)
def test_every_other_name_postgresql_accepts_is_usable(schema: str) -> None:
    assert schema_name_problem(schema) is None
    assert (
        RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", schema=schema).schema == schema
    )


def test_a_name_beside_parameters_has_its_percent_signs_doubled() -> None:
    assert name_for_parameters("a%sb", "outbox").as_string() == '"a%%sb"."outbox"'
    assert name_for_parameters('a"b').as_string() == '"a""b"'
