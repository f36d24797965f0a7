"""Hostile values at the pure edges: topic names, message ids, webhook bodies and signatures, secrets and
their masking, and the decision "is the database gone, or is this input bad?"."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from psycopg import errors

from postbox.inbox.message import MAX_MESSAGE_ID_BYTES, IdSource, MessageIdMissing
from postbox.inbox.webhooks.config import providers_from_env
from postbox.inbox.webhooks.providers import (
    MalformedWebhook,
    SignatureError,
    Stripe,
    stripe_signature_header,
)
from postbox.relay.core.db import database_unavailable, describe_error, storable_text
from postbox.relay.core.kafka_config import rdkafka_from_env
from postbox.relay.core.redact import MASK, redact, redact_url, scrub
from postbox.relay.core.secrets import secret, secret_list
from postbox.relay.outbox.routing import OutboxRow, RoutingError, check_topic_name, topic_for
from postbox.relay.outbox.settings import RelaySettings, SettingsError


def row(**overrides: object) -> OutboxRow:
    values: dict[str, object] = {
        "id": 1,
        "event_id": "e",
        "aggregate_type": "order",
        "aggregate_id": "o-1",
        "event_type": "Placed",
        "payload": "{}",
        "payload_bytes": None,
        "headers": None,
        "topic": None,
        "shard": 0,
    }
    values.update(overrides)
    return OutboxRow(**values)  # type: ignore[arg-type]


# -- topics ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topic",
    ["a/b", "with space", "x" * 250, "naïve", ".", "..", "__consumer_offsets", "__anything", "a\tb", "{x}"],
)
def test_an_illegal_or_internal_topic_is_a_routing_error(topic: str) -> None:
    with pytest.raises(RoutingError):
        check_topic_name(topic)
    with pytest.raises(RoutingError):
        topic_for(row(topic=topic), "outbox.event.{aggregate_type}")


@pytest.mark.parametrize("topic", ["a", "x" * 249, "orders.v1-eu_west", "_single.underscore"])
def test_legal_topics_pass(topic: str) -> None:
    assert check_topic_name(topic) == topic


def test_an_empty_routing_field_is_a_routing_error_not_outbox_event_dot() -> None:
    with pytest.raises(RoutingError, match="aggregate_type is empty"):
        topic_for(row(aggregate_type=""), "outbox.event.{aggregate_type}")
    with pytest.raises(RoutingError, match="event_type is empty"):
        topic_for(row(event_type=""), "svc.{event_type}")
    assert topic_for(row(event_type=""), "outbox.event.{aggregate_type}") == "outbox.event.order"


def test_formatter_metacharacters_in_a_row_are_data_not_template() -> None:
    with pytest.raises(RoutingError, match="not a legal Kafka topic"):
        topic_for(row(aggregate_type="{event_type}{0}"), "outbox.event.{aggregate_type}")


# -- message ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"a\x00b", "NUL"),
        (b"\xff\xfe", "not UTF-8"),
        (b"x" * (MAX_MESSAGE_ID_BYTES + 1), "over the"),
        (b"   ", "no 'id' header"),
    ],
)
def test_an_unusable_id_header_is_missing_with_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(MessageIdMissing, match=reason):
        IdSource.parse("header:id").extract("t", 0, 1, {"id": raw}, None)


def test_invalid_utf8_is_refused_not_replaced_so_two_ids_never_collide() -> None:
    source = IdSource.parse("header:id")
    with pytest.raises(MessageIdMissing):
        source.extract("t", 0, 1, {"id": b"a\xff"}, None)
    assert source.extract("t", 0, 1, {"id": "a\ufffd".encode()}, None) == "a\ufffd"


@pytest.mark.parametrize(
    "value",
    [
        b'{"id": "a\\u0000b"}',
        b'{"id": "\\ud800"}',
        b'{"id": ""}',
        json.dumps({"id": "y" * 5000}).encode(),
        b'{"id": 1' + b"0" * 5000 + b"}",
    ],
)
def test_an_unusable_payload_id_is_missing(value: bytes) -> None:
    with pytest.raises(MessageIdMissing):
        IdSource.parse("payload:id").extract("t", 0, 1, {}, value)


# -- webhooks --------------------------------------------------------------------------------------------

SECRET = "whsec_test"


def stripe(body: bytes) -> list[object]:
    provider = Stripe((SECRET,))
    now = int(time.time())
    provider.verify({"stripe-signature": stripe_signature_header(SECRET, body, now)}, body, now)
    return list(provider.events({}, body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "evt_1", "type": "a", "data": {"object": {"note": "x\\u0000y"}}}',
        b'{"id": "evt_1", "type": "a", "data": {"object": {"\\u0000": 1}}}',
        b'{"id": "evt_1", "type": "a", "data": {"object": {"note": "\\udc00"}}}',
        b'{"id": "evt_1", "type": "a", "amount": NaN}',
        b'{"id": "evt_1", "type": "a", "amount": -Infinity}',
        b'{"id": "evt_1", "type": "a", "amount": 1e400}',
        json.dumps({"id": "e" * 600, "type": "a"}).encode(),
        json.dumps({"id": "evt_1", "type": "t" * 600}).encode(),
        json.dumps({"id": "", "type": "a"}).encode(),
    ],
)
def test_a_signed_body_postgres_cannot_store_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedWebhook):
        stripe(body)


def test_escaped_backslashes_and_big_integers_are_still_accepted() -> None:
    (event,) = stripe(
        b'{"id": "evt_1", "type": "a", "note": "\\\\u0000", "n": 123456789012345678901234567890}'
    )
    assert event.payload["note"] == "\\u0000"  # type: ignore[attr-defined]


@pytest.mark.parametrize("timestamp", ["9" * 5000, "1" * 13, "1e9", "-5", "²"])
def test_an_absurd_stripe_timestamp_is_a_signature_error_before_any_arithmetic(timestamp: str) -> None:
    with pytest.raises(SignatureError):
        Stripe((SECRET,)).verify({"stripe-signature": f"t={timestamp},v1=00"}, b"{}", time.time())


@pytest.mark.parametrize("tolerance", ["inf", "nan", "1e12", "0", "-1"])
def test_an_unbounded_stripe_tolerance_is_refused(tolerance: str) -> None:
    with pytest.raises(ValueError, match=r"^--stripe-tolerance \(POSTBOX_WEBHOOK_STRIPE_TOLERANCE\)"):
        providers_from_env(
            {"POSTBOX_WEBHOOK_STRIPE_SECRETS": SECRET, "POSTBOX_WEBHOOK_STRIPE_TOLERANCE": tolerance}
        )


# -- secrets ---------------------------------------------------------------------------------------------


def test_secret_files_are_stripped_and_an_empty_one_is_an_error(tmp_path: object) -> None:
    from pathlib import Path  # noqa: PLC0415

    directory = Path(str(tmp_path))
    (directory / "good").write_text("  whsec_abc \r\n\n")
    (directory / "empty").write_text("\n  \n")
    assert secret("S", {"S_FILE": str(directory / "good")}) == "whsec_abc"
    with pytest.raises(ValueError, match=r"S_FILE=.*empty"):
        secret("S", {"S_FILE": str(directory / "empty")})
    with pytest.raises(ValueError, match=r"POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE=.*empty"):
        providers_from_env({"POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE": str(directory / "empty")})
    with pytest.raises(ValueError, match="S: the secret is empty"):
        secret("S", {"S": " "})
    with pytest.raises(ValueError, match="no secret"):
        secret_list("S", {"S": ", ,"})


def test_rdkafka_properties_can_come_from_files(tmp_path: object) -> None:
    from pathlib import Path  # noqa: PLC0415

    path = Path(str(tmp_path)) / "pw"
    path.write_text("kafka-pw\n")
    found = rdkafka_from_env(
        {"POSTBOX_RDKAFKA_SASL_PASSWORD_FILE": str(path), "POSTBOX_RDKAFKA_SASL_USERNAME": "u"}
    )
    assert found == {"sasl.password": "kafka-pw", "sasl.username": "u"}


PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("POSTBOX_RDKAFKA_SSL_KEY_PEM", PEM),
        ("rdkafka ssl.key.pem", PEM),
        ("rdkafka ssl.key.password", "hunter2"),
        ("POSTBOX_RDKAFKA_SSL_KEYSTORE_PASSWORD", "hunter2"),
        ("rdkafka sasl.oauthbearer.client.secret", "hunter2"),
        ("rdkafka sasl.oauthbearer.config", "principal=svc clientId=abc clientSecret=hunter2 scope=x"),
        ("anything", f"certificate follows {PEM}"),
        ("POSTBOX_DATABASE_URL", "postgresql://app:hun#ter2@db:5432/x"),
        ("POSTBOX_DATABASE_URL", "postgresql://app:hun@ter/2?@db/x"),
        ("POSTBOX_DATABASE_URL", "postgresql://db/x?sslmode=require&password=hunter2"),
        ("dsn", "host=db user=app password='hunter2 with spaces'"),
        ("dsn", "host=db password=hunter2 user=app"),
    ],
)
def test_key_material_and_passwords_are_masked_by_what_they_are(name: str, value: str) -> None:
    shown = redact(name, value)
    assert "hunter2" not in shown
    assert "MIIEvQ" not in shown
    assert MASK in shown


def test_the_rest_of_a_value_stays_readable() -> None:
    assert redact_url("postgresql://app:p#w@db:5432/x?sslmode=verify-full") == (
        f"postgresql://app:{MASK}@db:5432/x?sslmode=verify-full"
    )
    assert redact("rdkafka sasl.oauthbearer.config", "clientId=abc clientSecret=s") == (
        f"clientId=abc clientSecret={MASK}"
    )
    assert redact("POSTBOX_RDKAFKA_SSL_KEY_LOCATION", "/run/tls/key.pem") == "/run/tls/key.pem"
    assert redact("POSTBOX_RELAY_BATCH_SIZE", "1000") == "1000"


def test_an_error_message_is_scrubbed_of_the_password_it_quotes() -> None:
    message = 'invalid connection option "pass" in "postgresql://app:hunter2@db"'
    assert "hunter2" not in scrub(message, "hunter2")


# -- errors: by meaning, not by Python class ----------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "unavailable"),
    [
        (errors.ProgramLimitExceeded("index row size exceeds maximum"), False),  # an OperationalError!
        (errors.UntranslatableCharacter("NUL"), False),
        (errors.CharacterNotInRepertoire("bad"), False),
        (errors.NumericValueOutOfRange("integer out of range"), False),
        (errors.InvalidTextRepresentation("bad json"), False),
        (errors.UniqueViolation("dup"), False),
        (errors.AdminShutdown("terminating connection"), True),
        (errors.CrashShutdown("crash"), True),
        (errors.CannotConnectNow("starting up"), True),
        (errors.DiskFull("disk full"), True),
        (errors.TooManyConnections("too many"), True),
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (ValueError("not a database error"), False),
    ],
)
def test_database_unavailable_is_decided_by_sqlstate(exc: Exception, unavailable: bool) -> None:
    assert database_unavailable(exc) is unavailable


def test_errors_are_described_without_detail_or_context() -> None:
    assert describe_error(ValueError("first line\nCONTEXT: the payload")) == "first line"
    assert storable_text("a\x00b\ud800") == "a\\0b?"


def test_the_claims_byte_budget_is_validated() -> None:
    with pytest.raises(SettingsError, match="max-batch-bytes"):
        RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", max_batch_bytes=10)
    with pytest.raises(SettingsError, match=r"message\.max\.bytes"):
        RelaySettings(
            database_url="postgresql://x",
            kafka_bootstrap="k:9092",
            kafka_config={"message.max.bytes": "lots"},
        )
    assert (
        RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092").event_type_header
        == "eventType"
    )
