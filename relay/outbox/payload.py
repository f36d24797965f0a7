"""From a service's values to what an outbox row stores: one documented encoding. Pure, no I/O.

JSON payloads and header values are encoded by `encode_json`, which takes what `json.dumps` takes and,
by one rule each (docs/how-to/write-events.md):
- a pydantic v2 model: its `model_dump(mode="json")` (its own aliases and serializers apply);
- a dataclass instance: its fields, as `dataclasses.asdict` gives them, each encoded by these rules;
- `Decimal`: a string of its exact digits (`Decimal("12.30")` -> "12.30"): a JSON number would pass
  through binary floating point in most consumers, and a finite amount must arrive as written;
- `datetime`, `date`, `time`: ISO 8601, the UTC offset kept as given (a naive datetime stays naive);
- `UUID`: its canonical text; an `Enum` member: its value, encoded by these rules;
- `set` and `frozenset`: a list (sorted when its items can be, so the text is stable);
- anything else: the service's own `default` hook (enqueue's `json_default=`), else PayloadError.
NaN and the infinities are refused (they are not JSON, and jsonb refuses them).

Aggregate ids that are not text (int, UUID, a str-valued Enum) become text by `aggregate_key`: the
Kafka key is bytes, so one rule must say which bytes.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import json.encoder
import uuid
from collections.abc import Callable
from typing import Any

JsonDefault = Callable[[Any], Any]


class PayloadError(ValueError):
    """The event cannot be stored as given (not JSON-serialisable, bad headers); nothing was written."""


def _finite(value: decimal.Decimal) -> str:
    if not value.is_finite():
        raise ValueError(f"Decimal {value} is not a JSON value")
    return str(value)


def _sorted_if_possible(value: set[Any] | frozenset[Any]) -> list[Any]:
    try:
        return sorted(value)
    except TypeError:
        return list(value)


# The module's rules, in order: (is it this kind of value, its JSON-ready form).
_ENCODINGS: tuple[tuple[Callable[[Any], bool], Callable[[Any], Any]], ...] = (
    # pydantic v2, recognised without importing it
    (
        lambda v: hasattr(type(v), "model_fields") and hasattr(v, "model_dump"),
        lambda v: v.model_dump(mode="json"),
    ),
    (lambda v: dataclasses.is_dataclass(v) and not isinstance(v, type), dataclasses.asdict),
    (lambda v: isinstance(v, decimal.Decimal), _finite),
    (lambda v: isinstance(v, datetime.datetime | datetime.date | datetime.time), lambda v: v.isoformat()),
    (lambda v: isinstance(v, uuid.UUID), str),
    (lambda v: isinstance(v, enum.Enum), lambda v: v.value),
    (lambda v: isinstance(v, set | frozenset), _sorted_if_possible),
)


def _builtin_default(value: Any) -> Any:
    """The encodings above for what json.dumps does not know, or TypeError."""
    for applies, encoded in _ENCODINGS:
        if applies(value):
            return encoded(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The encoder for the usual call (no hook of the service's own), made once: json.dumps with any option
# builds a new JSONEncoder per call, about a microsecond of an event's cost.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=_builtin_default)


def _c_encoder() -> Callable[[Any, int], Any] | None:
    """The C encoder JSONEncoder.encode builds on every call (about 1.6 us of a 3 us encoding), built once.
    It keeps no record of the containers it is in (that record is per call, so no shared encoder can keep
    one): a circular value recurses until RecursionError, and encode_json then asks _ENCODER, which says
    "Circular reference detected" as before. None where the C accelerator is missing or differs."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        encoder: Callable[[Any, int], Any] = make(
            None, _builtin_default, json.encoder.encode_basestring, None, ": ", ", ", False, False, False
        )
        probe = {"a": [1, 2.5, None, True], "b": "\x00\ud800é"}
        if "".join(encoder(probe, 0)) != _ENCODER.encode(probe):
            return None
    except Exception:  # noqa: BLE001  (any surprise: the documented encoder is used instead)
        return None
    return encoder


_FAST = _c_encoder()


def encode_json(value: Any, default: JsonDefault | None = None) -> str:
    """`value` as JSON text (see the module's rules); TypeError or ValueError when it cannot be.

    ensure_ascii=False keeps NUL and lone surrogates as characters, where the storability check finds
    them; allow_nan=False: NaN and Infinity are not JSON."""
    if default is None:
        if _FAST is None:
            return _ENCODER.encode(value)
        try:
            return "".join(_FAST(value, 0))
        except RecursionError:
            return _ENCODER.encode(value)  # a circular value: ValueError; a deep one: RecursionError again

    def encode(item: Any) -> Any:
        try:
            return _builtin_default(item)
        except TypeError:
            return default(item)

    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=encode)


def aggregate_key(value: object) -> str:
    """An aggregate id as the text the outbox stores (the Kafka key's UTF-8): a str as it is; an int, a
    UUID or an Enum member (by its value) as str() gives it. Anything else (bytes, floats, None) is
    refused: its text form is not one a consumer could rebuild the same way."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):  # an int, but True/False keys are a bug, not an id
        raise PayloadError(f"aggregate_id must be a str, int or UUID, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, int | uuid.UUID):
        return str(value)
    raise PayloadError(f"aggregate_id must be a str, int or UUID, got {type(value).__name__}")
