"""The writers' fast paths decide exactly as the checks they stand in for (relay.outbox.enqueue, .payload,
.writers): the same rows, the same PayloadError messages, the same JSON text; and the statements they
keep are the ones each driver needs, whatever the schema's name."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postbox.relay.outbox.enqueue import OutboxEvent, PayloadError, _row
from postbox.relay.outbox.payload import _ENCODER, encode_json
from postbox.relay.outbox.writers import (
    _asyncpg_statements,
    _psycopg_statements,
    _sqlalchemy_statements,
    check_target,
    kind_of,
)


class _Text(str):
    """A str of another class: the fast path leaves it to the checks one by one."""

    __slots__ = ()


def _outcome(event: OutboxEvent) -> object:
    try:
        return _row(event)[1:]
    except PayloadError as exc:
        return f"PayloadError: {exc}"


texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "a\x00b", "\ud800", "é", "order", "x" * 40]),
)


@settings(max_examples=400, deadline=None)
@given(aggregate_type=texts, aggregate_id=texts, event_type=texts, topic=st.none() | texts)
def test_the_one_pass_check_of_names_decides_as_the_checks_one_by_one(
    aggregate_type: str, aggregate_id: str, event_type: str, topic: str | None
) -> None:
    fast = OutboxEvent(aggregate_type, aggregate_id, event_type, {}, topic=topic)
    slow = OutboxEvent(
        _Text(aggregate_type),
        _Text(aggregate_id),
        _Text(event_type),
        {},
        topic=None if topic is None else _Text(topic),
        event_id=fast.event_id,
    )
    assert _outcome(fast) == _outcome(slow)


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (OutboxEvent(1, "a", "E", {}), "aggregate_type must be a non-empty string, got 1"),  # type: ignore[arg-type]
        (OutboxEvent("t", "a", None, {}), "event_type must be a non-empty string, got None"),  # type: ignore[arg-type]
        (OutboxEvent("t", "a", "E", {}, topic=5), "topic must be a str or None, got int"),  # type: ignore[arg-type]
        (OutboxEvent("t", "a\x00", "E", {}), "aggregate_id contains NUL"),
        (OutboxEvent("t", "a", "E", {}, topic="t\x00"), "topic contains NUL"),
        (OutboxEvent("t", "a", "E", {}, topic="\udc00"), "topic is not valid Unicode"),
        (OutboxEvent("t", "a", "E", {}, {"k": 1}), "headers must map str to str"),  # type: ignore[dict-item]
    ],
)
def test_each_refusal_still_names_the_value(event: OutboxEvent, message: str) -> None:
    with pytest.raises(PayloadError, match=re.escape(message)):
        _row(event)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_the_kept_c_encoder_writes_what_jsonencoder_writes(value: Any) -> None:
    assert encode_json(value) == _ENCODER.encode(value)
    assert json.loads(encode_json(value)) == json.loads(json.dumps(value))


def test_a_circular_payload_is_still_refused_as_circular_and_a_deep_one_as_too_deep() -> None:
    circular: list[object] = []
    circular.append(circular)
    with pytest.raises(PayloadError, match="not JSON-serialisable: Circular reference detected"):
        _row(OutboxEvent("t", "a", "E", circular))
    deep: object = "leaf"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested too deeply"):
        _row(OutboxEvent("t", "a", "E", deep))
    with pytest.raises(ValueError, match="Out of range float"):
        encode_json([float("nan")])


def test_an_event_id_is_a_uuid_in_the_row_and_text_in_a_uuids_form_is_taken() -> None:
    given_id = uuid.uuid4()
    assert _row(OutboxEvent("t", "a", "E", {}, event_id=given_id))[0] is given_id
    assert _row(OutboxEvent("t", "a", "E", {}, event_id=str(given_id)))[0] == given_id  # type: ignore[arg-type]
    with pytest.raises(PayloadError, match="event_id must be a UUID, got 'nope'"):
        _row(OutboxEvent("t", "a", "E", {}, event_id="nope"))  # type: ignore[arg-type]


ODD = 'Odd "s" 50%s %b :p1 $1'


def test_the_kept_statements_quote_the_schema_for_each_drivers_placeholders() -> None:
    one, many = _psycopg_statements(ODD)
    table = '"Odd ""s"" 50%%s %%b :p1 $1"."outbox"'
    assert one.startswith(f"INSERT INTO {table} (event_id, ")
    assert one.endswith("VALUES (%s, %s, %s, %s, %s, %s, %s, %s)")
    assert many.startswith(f"INSERT INTO {table} ")
    assert re.findall(r"%b::(\w+\[\])", many) == [
        "uuid[]", "text[]", "text[]", "text[]", "jsonb[]", "bytea[]", "jsonb[]", "text[]"
    ]  # fmt: skip
    assert "WITH ORDINALITY" in many
    assert many.endswith("ORDER BY n")
    one, many = _asyncpg_statements(ODD)
    assert one.startswith('INSERT INTO "Odd ""s"" 50%s %b :p1 $1"."outbox"')
    assert re.findall(r"\$(\d)::", one) == re.findall(r"\$(\d)::", many) == [str(n) for n in range(1, 9)]
    sa_one, sa_many = _sqlalchemy_statements(ODD)
    assert (
        sorted(sa_one.compile().params) == sorted(sa_many.compile().params) == [f"p{n}" for n in range(1, 9)]
    )
    assert _psycopg_statements(ODD) is _psycopg_statements(ODD)  # built once


class _Unsupported:
    pass


def test_a_kind_once_found_is_kept_for_the_class_and_misuse_is_still_refused() -> None:
    import psycopg  # noqa: PLC0415

    cursor = psycopg.Cursor.__new__(psycopg.Cursor)  # an instance for its class only: never used
    assert kind_of(cursor) == kind_of(cursor) == "psycopg"
    assert check_target(cursor, want_async=False) == "psycopg"
    with pytest.raises(TypeError, match="is synchronous"):
        check_target(cursor, want_async=True)
    assert kind_of(_Unsupported()) is None
    with pytest.raises(TypeError, match=r"postbox cannot write through a .*_Unsupported"):
        check_target(_Unsupported(), want_async=False)
