import pytest

from postbox.relay.outbox.routing import (
    OutboxRow,
    RoutingError,
    TopicRoutes,
    TopicTemplate,
    load_headers,
    raised_in,
    to_message,
    topic_for,
    unpreparable_reason,
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


@pytest.mark.parametrize(
    "template",
    [
        "",
        "x.{aggregate}",
        "{payload}",
        # Only the two placeholders, written exactly so: anything else would hand a row's value to a
        # formatter (a 100 MB topic per row, a ValueError per row, quotes in every topic).
        "outbox.{aggregate_type:>99999999}",
        "outbox.{aggregate_type:d}",
        "outbox.{aggregate_type:}",
        "outbox.{aggregate_type!r}",
        "outbox.{aggregate_type!s}",
        "outbox.{aggregate_type[0]}",
        "outbox.{aggregate_type.upper}",
        "outbox.{event_type.__class__}",
        "outbox.{}",
        "outbox.{0}",
        "outbox.{{aggregate_type}}",
        "outbox.{aggregate_type",
        "outbox.aggregate_type}",
        "outbox.{ aggregate_type }",
        "outbox.{AGGREGATE_TYPE}",
    ],
)
def test_a_template_may_hold_only_the_two_placeholders_exactly(template: str) -> None:
    with pytest.raises(ValueError, match="may use only"):
        validate_topic_template(template)


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("outbox event.{aggregate_type}", "can be in no Kafka topic name"),
        ("outbox/{aggregate_type}", "can be in no Kafka topic name"),
        ("naïve.{aggregate_type}", "can be in no Kafka topic name"),
        ("__internal.{aggregate_type}", "Kafka's internal topics"),
        ("t" * 250 + "{aggregate_type}", "longer than a Kafka topic name"),
        ("..", "not a legal Kafka topic name"),
        ("__consumer_offsets", "internal topics"),
    ],
)
def test_a_template_no_row_could_ever_be_published_by_is_refused(template: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        validate_topic_template(template)


@pytest.mark.parametrize(
    "template",
    [
        "outbox.event.{aggregate_type}",
        "svc.{aggregate_type}.{event_type}",
        "{event_type}",
        "{aggregate_type}{event_type}",
        "one-fixed_topic.v1",
        "_single.{aggregate_type}",
    ],
)
def test_documented_templates_are_accepted(template: str) -> None:
    assert validate_topic_template(template) == template


def test_a_template_is_split_once_into_literals_and_fields() -> None:
    template = TopicTemplate("svc.{aggregate_type}.{event_type}-v1")
    assert template.literals == ("svc.", ".", "-v1")
    assert template.fields == ("aggregate_type", "event_type")
    assert template.render(row()) == "svc.order.OrderPlaced-v1"
    assert TopicTemplate("fixed").render(row(aggregate_type="")) == "fixed", "no field, nothing needed"


@pytest.mark.parametrize(
    "value", ["{event_type}", "{0}", "{aggregate_type:>99999999}", "{aggregate_type!r}", "%s", "%(x)s", "{"]
)
def test_a_rows_fields_are_data_never_a_template(value: str) -> None:
    """Whatever formatter syntax a writer puts in a routing field is copied as text (and then refused as a
    topic name, since braces and percent signs are not legal there): no format spec ever runs."""
    assert TopicTemplate("p.{aggregate_type}").render(row(aggregate_type=value)) == f"p.{value}"
    with pytest.raises(RoutingError, match="not a legal Kafka topic name"):
        topic_for(row(aggregate_type=value), "p.{aggregate_type}")
    with pytest.raises(RoutingError, match="not a legal Kafka topic name"):
        topic_for(row(event_type=value), "p.{aggregate_type}.{event_type}")


def test_headers_are_loaded_from_their_json_text() -> None:
    assert load_headers('{"traceparent": "00-ab-cd-01"}') == {"traceparent": "00-ab-cd-01"}
    with pytest.raises(RoutingError, match="not a JSON object"):
        load_headers("[1, 2]")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"n": 1' + "0" * 5000 + "}", ValueError),  # past Python's 4,300-digit int(str) limit
        ('{"n": ' + "[" * 5000 + "]" * 5000 + "}", RecursionError),  # jsonb stores it, Python cannot load
    ],
)
def test_headers_python_cannot_load_park_the_row_with_the_class_and_no_contents(
    text: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as raised:
        load_headers(text)
    reason = unpreparable_reason(raised.value)
    assert reason == f"the row could not be made into a message: {error.__name__} in load_headers"
    assert "000" not in reason
    assert "[[" not in reason
    assert raised_in(raised.value).startswith("load_headers (routing.py:")


def test_a_routing_error_parks_the_row_with_its_own_words() -> None:
    assert unpreparable_reason(RoutingError("topic 'a b' is not a legal Kafka topic name")) == (
        "topic 'a b' is not a legal Kafka topic name"
    )


def test_a_long_value_is_quoted_cut_short_in_a_reason() -> None:
    with pytest.raises(RoutingError) as raised:
        to_message(row(headers={"h" * 10_000: 5}), "t")
    assert len(str(raised.value)) < 200
    with pytest.raises(RoutingError) as raised:
        topic_for(row(topic="x y" * 10_000), "t.{aggregate_type}")
    assert len(str(raised.value)) < 200


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
