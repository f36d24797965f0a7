"""librdkafka pass-through settings, from the environment and from repeated --kafka-config flags. Pure, apart
from with_structlog_logger's shared log adapter."""

from __future__ import annotations

import functools
import os
import re
from typing import Any, TypeVar

from postbox.relay.core.secrets import secret

_RDKAFKA_ENV = re.compile(r"^POSTBOX_RDKAFKA_([A-Z0-9_]+)$")


def rdkafka_from_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """librdkafka properties from POSTBOX_RDKAFKA_<NAME>, dots written as underscores.

    POSTBOX_RDKAFKA_SECURITY_PROTOCOL=SASL_SSL  ->  security.protocol=SASL_SSL
    POSTBOX_RDKAFKA_SASL_PASSWORD_FILE=/run/secrets/kafka  ->  sasl.password=<the file's contents>
    """
    environ = dict(os.environ) if environ is None else environ
    found: dict[str, str] = {}
    for name in environ:
        match = _RDKAFKA_ENV.match(name)
        if match:
            variable = name.removesuffix("_FILE")
            # A property written to a file (a mounted Secret) is a secret; one set inline is taken as given.
            value = secret(variable, environ) if name.endswith("_FILE") else environ[name]
            assert value is not None
            found[_RDKAFKA_ENV.sub(r"\1", variable).lower().replace("_", ".")] = value
    return found


def parse_kafka_config(pairs: list[str]) -> dict[str, str]:
    """`key=value` strings (the repeated --kafka-config flag) to a dict."""
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--kafka-config: {pair!r} is not key=value")
        config[key.strip()] = value
    return config


def kafka_config_from(flags: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment's properties, overridden by the flags'."""
    return {**rdkafka_from_env(environ), **parse_kafka_config(flags)}


C = TypeVar("C", bound=dict[str, Any])


@functools.cache
def _shared_log_adapter() -> Any:
    from postbox.relay.core.kafka_logs import KafkaLogAdapter  # noqa: PLC0415

    return KafkaLogAdapter()


def with_structlog_logger(config: C) -> C:
    """`config` for a confluent_kafka Producer, Consumer or AdminClient, with librdkafka's log lines sent
    through structlog and rate-limited (relay.core.kafka_logs) instead of printed raw on stderr. One adapter
    for the whole process, so a message repeated by several clients is limited once."""
    return {**config, "logger": _shared_log_adapter()}  # type: ignore[return-value]
