import pytest

from postbox.inbox import Inbox, Message
from postbox.inbox.message import IdSource, MessageIdMissing


def extract(source: str, headers: dict[str, bytes] | None = None, value: bytes | None = None) -> str:
    return IdSource.parse(source).extract("t", 2, 40, headers or {}, value)


def test_the_id_header_is_the_default_source() -> None:
    assert extract("header:id", {"id": b"e-1"}) == "e-1"
    with pytest.raises(MessageIdMissing, match="no 'id' header"):
        extract("header:id", {"other": b"x"})


def test_a_payload_path_and_coordinates() -> None:
    assert extract("payload:data.object.id", value=b'{"data": {"object": {"id": 7}}}') == "7"
    with pytest.raises(MessageIdMissing, match=r"no 'data\.id'"):
        extract("payload:data.id", value=b'{"data": 1}')
    with pytest.raises(MessageIdMissing, match="not JSON"):
        extract("payload:id", value=b"\xff")
    assert extract("coordinates") == "t/2/40"


@pytest.mark.parametrize("text", ["", "header:", "payload", "coords", "coordinates:x"])
def test_bad_sources_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="message-id source"):
        IdSource.parse(text)


def message(event_type: str | None) -> Message:
    return Message("t", 0, 1, b"k", b'{"a": 1}', {}, "id-1", event_type)


def test_handlers_are_found_by_event_type_then_fallback() -> None:
    inbox = Inbox("svc")

    @inbox.handler("A")
    def handle_a(tx: object, m: Message) -> None: ...

    assert inbox.handler_for(message("A")) == (handle_a, None)
    assert inbox.handler_for(message("B")) is None

    @inbox.fallback
    def other(tx: object, m: Message) -> None: ...

    assert inbox.handler_for(message("B")) == (other, None)
    assert inbox.handler_for(message(None)) == (other, None)
    with pytest.raises(ValueError, match="already registered"):
        inbox.handler("A")(handle_a)


def test_message_payload_and_key() -> None:
    m = message("A")
    assert m.payload == {"a": 1}
    assert m.key_text == "k"
    assert Message("t", 0, 1, None, None, {}, "x", None).payload is None


def test_an_offset_fetch_a_stale_coordinator_refused_renews_the_consumer() -> None:
    """librdkafka never retries an offset fetch refused as a whole (confluentinc/librdkafka#5586): the
    consumer takes a new assignment instead of waiting forever; other errors do not renew it."""
    from confluent_kafka import KafkaError  # noqa: PLC0415

    from postbox.inbox.consumer import leaves_assignment_stuck  # noqa: PLC0415

    seen_in_the_soak = (
        'Failed to fetch committed offsets for 0 partition(s) in group "ledger": Broker: Not coordinator'
    )
    assert leaves_assignment_stuck(KafkaError(KafkaError.NOT_COORDINATOR, seen_in_the_soak))
    loading = "Failed to fetch committed offsets for 3 partition(s): Broker: Coordinator load in progress"
    assert leaves_assignment_stuck(KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, loading))
    assert not leaves_assignment_stuck(KafkaError(KafkaError.NOT_COORDINATOR, "Offset commit failed"))
    assert not leaves_assignment_stuck(KafkaError(KafkaError._TRANSPORT, "Failed to fetch committed offsets"))
