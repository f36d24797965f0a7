"""Poison inputs to enqueue: refused with a clear PayloadError before any write, never a database error
halfway through the caller's transaction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postbox.relay.outbox.enqueue import OutboxEvent, PayloadError, _row


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (OutboxEvent("order", "o\x001", "E", {}), "aggregate_id contains NUL"),
        (OutboxEvent("order", "o1", "E", {"note": "a\x00b"}), "payload contains NUL"),
        (OutboxEvent("order", "o1", "E", {}, headers={"h": "\x00"}), "headers contains NUL"),
        (OutboxEvent("order", "o1", "E", {"note": "\ud800"}), "payload is not valid Unicode"),
        (OutboxEvent("order", "\udfff", "E", {}), "aggregate_id is not valid Unicode"),
        (OutboxEvent("order", "o1", "E", {"x": float("inf")}), "not JSON-serialisable"),
        (OutboxEvent("order", "", "E", {}), "aggregate_id must be a non-empty string"),
    ],
)
def test_unstorable_events_are_refused_naming_the_field(event: OutboxEvent, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        _row(event)


def test_bytes_payloads_may_hold_anything() -> None:
    assert _row(OutboxEvent("blob", "b1", "E", b"\x00\xff\xfe"))[5] == b"\x00\xff\xfe"


@settings(max_examples=500, deadline=None)
@given(
    aggregate_id=st.text(min_size=1, max_size=50), value=st.text(max_size=200), header=st.text(max_size=50)
)
def test_any_text_is_either_storable_or_refused_cleanly(aggregate_id: str, value: str, header: str) -> None:
    try:
        row = _row(OutboxEvent("t", aggregate_id, "E", {"v": value, value: 1}, headers={"h": header}))
    except PayloadError:
        assert any("\x00" in s or not _utf8(s) for s in (aggregate_id, value, header))
        return
    assert all(isinstance(part, str | bytes | type(None)) for part in row[1:])


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_a_payload_nested_too_deeply_is_a_payload_error() -> None:
    # Found by the atheris target outbox_row: it used to escape as RecursionError.
    payload: object = "leaf"
    for _ in range(5000):
        payload = [payload]
    with pytest.raises(PayloadError, match="nested too deeply"):
        _row(OutboxEvent("order", "o-1", "Placed", payload))  # type: ignore[arg-type]


def test_an_empty_header_name_is_refused() -> None:
    with pytest.raises(PayloadError, match="empty"):
        _row(OutboxEvent("order", "o-1", "Placed", {}, {"": "x"}))
