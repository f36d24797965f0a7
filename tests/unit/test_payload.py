"""The one documented encoding of typed payloads and aggregate ids (relay.outbox.payload)."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import uuid
from dataclasses import dataclass

import pydantic
import pytest

from postbox.relay.outbox import OutboxEvent, PayloadError
from postbox.relay.outbox.enqueue import _rows
from postbox.relay.outbox.payload import aggregate_key, encode_json


class Status(enum.Enum):
    PLACED = "placed"


@dataclass
class Line:
    sku: str
    price: decimal.Decimal


class Order(pydantic.BaseModel):
    id: uuid.UUID
    total: decimal.Decimal
    at: datetime.datetime


ORDER_ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
AT = datetime.datetime(2026, 12, 7, 10, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))


def test_typed_values_encode_by_one_rule_each() -> None:
    value = {
        "line": Line("a-1", decimal.Decimal("12.30")),
        "at": AT,
        "day": datetime.date(2026, 12, 7),
        "id": ORDER_ID,
        "status": Status.PLACED,
        "tags": {"b", "a"},
    }
    assert json.loads(encode_json(value)) == {
        "line": {"sku": "a-1", "price": "12.30"},  # Decimal: its exact digits, as a string
        "at": "2026-12-07T10:30:00+02:00",  # the offset as given
        "day": "2026-12-07",
        "id": str(ORDER_ID),
        "status": "placed",
        "tags": ["a", "b"],
    }


def test_a_pydantic_model_is_its_json_dump() -> None:
    order = Order(id=ORDER_ID, total=decimal.Decimal("9.99"), at=AT)
    assert json.loads(encode_json(order)) == order.model_dump(mode="json")


def test_a_services_own_type_goes_through_its_hook_and_nothing_else_is_guessed() -> None:
    class Money:
        cents = 1234

    assert encode_json({"m": Money()}, default=lambda m: {"cents": m.cents}) == '{"m": {"cents": 1234}}'
    with pytest.raises(TypeError, match="Money is not JSON serializable"):
        encode_json({"m": Money()})
    with pytest.raises(ValueError, match="not a JSON value"):
        encode_json(decimal.Decimal("NaN"))
    with pytest.raises(ValueError, match="Out of range float"):
        encode_json(float("inf"))


def test_payload_errors_name_the_event_before_anything_is_written() -> None:
    with pytest.raises(PayloadError, match="payload of Placed is not JSON-serialisable"):
        _rows([OutboxEvent("order", "o-1", "Placed", {"x": object()})], None)


def test_aggregate_ids_that_are_not_text_become_text_by_one_rule() -> None:
    assert [aggregate_key(v) for v in ("o-1", 42, ORDER_ID)] == ["o-1", "42", str(ORDER_ID)]
    [row] = _rows([OutboxEvent("order", 42, "Placed", {})], None)
    assert row[2] == "42"
    for refused in (True, 4.2, b"o-1", None):
        with pytest.raises(PayloadError, match="aggregate_id must be a str, int or UUID"):
            aggregate_key(refused)
