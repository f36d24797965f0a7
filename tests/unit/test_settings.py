import pytest

from postbox.relay.core.kafka_config import parse_kafka_config, rdkafka_from_env
from postbox.relay.outbox.settings import (
    LOG_BATCH_ROWS,
    RelaySettings,
    SettingsError,
    mode_to_follow,
)


def settings(**overrides: object) -> RelaySettings:
    return RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", **overrides)  # type: ignore[arg-type]


def test_producer_config_is_safe_by_default() -> None:
    config = settings().producer_config()
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"
    assert config["partitioner"] == "murmur2_random"
    assert config["message.timeout.ms"] == 20_000


@pytest.mark.parametrize(
    ("in_log_mode", "shards_behind_switch", "mode"),
    [(False, 0, "queue"), (True, 0, "log"), (False, 3, "log")],
)
def test_auto_follows_the_outbox_and_reads_the_log_to_a_switch_back(
    in_log_mode: bool, shards_behind_switch: int, mode: str
) -> None:
    assert mode_to_follow(in_log_mode, shards_behind_switch) == mode


def test_auto_is_the_default_and_the_producer_has_room_for_either_sources_batches() -> None:
    auto = settings()
    assert auto.mode == "auto"
    # The producer is built before the mode is known: its buffer has room for either default.
    assert auto.producer_config()["queue.buffering.max.messages"] >= LOG_BATCH_ROWS * auto.lanes * 4


def test_pass_through_settings_reach_librdkafka() -> None:
    config = settings(kafka_config={"security.protocol": "SASL_SSL", "linger.ms": "20"}).producer_config()
    assert config["security.protocol"] == "SASL_SSL"
    assert config["linger.ms"] == "20"


@pytest.mark.parametrize(("key", "value"), [("acks", "1"), ("enable.idempotence", "false")])
def test_pass_through_cannot_weaken_delivery(key: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"kafka-config {key}={value}"):
        settings(kafka_config={key: value})


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"batch_size": 0}, "batch-size"),
        ({"lanes": 0}, "lanes"),
        ({"lanes": 9}, "lanes"),
        ({"lease_ttl": 0.1}, "lease-ttl"),
        ({"relay_id": "has space"}, "relay-id"),
        ({"topic_template": "{nope}"}, "topic-template"),
    ],
)
def test_bad_settings_name_the_setting(overrides: dict[str, object], name: str) -> None:
    with pytest.raises(SettingsError, match=rf"^--{name} \(POSTBOX_RELAY_"):
        settings(**overrides)


def test_missing_connection_settings_name_their_variables() -> None:
    with pytest.raises(SettingsError, match="POSTBOX_KAFKA_BOOTSTRAP"):
        RelaySettings(database_url="postgresql://x", kafka_bootstrap="")


def test_rdkafka_env_and_flags() -> None:
    env = {
        "POSTBOX_RDKAFKA_SASL_MECHANISMS": "PLAIN",
        "POSTBOX_RDKAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "OTHER": "x",
    }
    assert rdkafka_from_env(env) == {"sasl.mechanisms": "PLAIN", "security.protocol": "SASL_SSL"}
    assert parse_kafka_config(["a.b=c=d"]) == {"a.b": "c=d"}
    with pytest.raises(ValueError, match="not key=value"):
        parse_kafka_config(["novalue"])


@pytest.mark.parametrize(
    ("key", "value"),
    [("enable.auto.commit", "false"), ("enable.auto.commit", "true"), ("enable.auto.offset.store", "true")],
)
def test_the_inbox_owns_its_offset_settings(key: str, value: str) -> None:
    """Offsets are stored after each batch's database commit; a pass-through that stored them earlier
    (auto offset store) could skip a batch that was never applied, so neither key may be given."""
    from postbox.inbox.consumer import ConsumerSettings  # noqa: PLC0415

    with pytest.raises(SettingsError, match=f"kafka-config {key}: postbox stores each batch's offsets"):
        ConsumerSettings(
            database_url="postgresql://x", kafka_bootstrap="k:9092", topics=["t"], kafka_config={key: value}
        )
