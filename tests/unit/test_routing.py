import pytest

from relay.outbox.routing import (
    OutboxRow,
    RoutingError,
    TopicRoutes,
    to_message,
    topic_for,
    validate_topic_template,
)

EVENT_ID = "12345678-1234-5678-1234-567812345678"


def row(**overrides: object) -> OutboxRow:
    values: dict[str, object] = {
        "id": 1,
        "event_id": EVENT_ID,
        "aggregate_type": "order",
        "aggregate_id": "o-1",
        "event_type": "OrderPlaced",
        "payload": '{"total": 5}',
        "payload_bytes": None,
        "headers": {},
        "topic": None,
        "shard": 3,
    }
    values.update(overrides)
    return OutboxRow(**values)  # type: ignore[arg-type]


def test_default_is_the_debezium_outbox_router_format() -> None:
    default = row()
    message = to_message(default, topic_for(default, "outbox.event.{aggregate_type}"))
    assert message.topic == "outbox.event.order"
    assert message.key == b"o-1"
    assert message.value == b'{"total": 5}'
    assert message.headers == [("id", b"12345678-1234-5678-1234-567812345678")]


def test_row_topic_overrides_the_template() -> None:
    assert topic_for(row(topic="billing.special"), "outbox.event.{aggregate_type}") == "billing.special"


def test_template_may_use_event_type() -> None:
    assert topic_for(row(), "svc.{aggregate_type}.{event_type}") == "svc.order.OrderPlaced"


def test_user_headers_travel_but_cannot_forge_the_id() -> None:
    message = to_message(row(headers={"traceparent": "00-ab-cd-01", "id": "forged"}), "t")
    assert message.headers == [("id", str(EVENT_ID).encode()), ("traceparent", b"00-ab-cd-01")]


def test_bytes_payload_is_sent_as_is_and_null_payload_is_a_tombstone() -> None:
    assert to_message(row(payload=None, payload_bytes=b"\x00\xff"), "t").value == b"\x00\xff"
    assert to_message(row(payload=None), "t").value is None


def test_non_string_header_is_a_routing_error() -> None:
    with pytest.raises(RoutingError, match="header 'n' is not a string"):
        to_message(row(headers={"n": 5}), "t")


@pytest.mark.parametrize("template", ["", "x.{aggregate}", "{payload}"])
def test_bad_templates_are_rejected(template: str) -> None:
    with pytest.raises(ValueError, match="may use only"):
        validate_topic_template(template)


def test_the_event_type_header_is_sent_when_named_and_only_then() -> None:
    assert ("eventType", b"OrderPlaced") in to_message(row(), "t", "eventType").headers
    assert all(name != "eventType" for name, _ in to_message(row(), "t").headers)


def test_an_empty_header_name_is_a_routing_error() -> None:
    with pytest.raises(RoutingError, match="empty"):
        to_message(row(headers={"": "x"}), "t")


def test_remembered_routes_answer_as_topic_for_does_every_time() -> None:
    template = "svc.{aggregate_type}.{event_type}"
    routes = TopicRoutes(template, limit=3)
    rows = [row(), row(topic="billing.special"), row(event_type=""), row(aggregate_type="a b"), row()]
    for _ in range(2):  # the second round is answered from memory, past the limit too
        for each in rows:
            try:
                expected: str | RoutingError = topic_for(each, template)
            except RoutingError as exc:
                expected = exc
            if isinstance(expected, RoutingError):
                with pytest.raises(RoutingError) as raised:
                    routes.topic(each)
                assert str(raised.value) == str(expected)
            else:
                assert routes.topic(each) == expected


def test_remembered_routes_hold_at_most_their_limit() -> None:
    routes = TopicRoutes("outbox.event.{aggregate_type}", limit=10)
    for i in range(100):
        assert routes.topic(row(aggregate_type=f"t{i}")) == f"outbox.event.t{i}"
    assert len(routes._known) <= 10


def test_long_fields_are_routed_but_not_remembered() -> None:
    routes = TopicRoutes("outbox.event.{aggregate_type}", key_chars=100)
    with pytest.raises(RoutingError, match="not a legal Kafka topic name"):
        routes.topic(row(aggregate_type="t" * 300))
    assert routes.topic(row(event_type="E" * 200)) == "outbox.event.order"
    assert routes._known == {}
