import subprocess
import sys

import pytest

from relay.core.redact import MASK, redact, redact_url
from tests.support import REPO


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("POSTBOX_STRIPE_SECRETS", "whsec_abc", MASK),
        ("POSTBOX_MARQETA_PASSWORD", "pw", MASK),
        ("POSTBOX_RDKAFKA_SASL_PASSWORD", "pw", MASK),
        ("rdkafka sasl.password", "pw", MASK),
        ("POSTBOX_STRIPE_SECRETS_FILE", "/run/secrets/stripe", "/run/secrets/stripe"),
        ("POSTBOX_BATCH_SIZE", "500", "500"),
        (
            "POSTBOX_DATABASE_URL",
            "postgresql://app:s3cret@db:5432/x?sslmode=verify-full",
            f"postgresql://app:{MASK}@db:5432/x?sslmode=verify-full",
        ),
        ("dsn", "host=db user=app password=s3cret", f"host=db user=app password={MASK}"),
    ],
)
def test_secrets_are_masked_and_the_rest_shown(name: str, value: str, shown: str) -> None:
    assert redact(name, value) == shown


def test_url_password_options_are_masked_too() -> None:
    assert "s3cret" not in redact_url("postgresql://db/x?user=a&password=s3cret")


def run_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay.cli", "config", "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", **env},
        check=False,
    )


def test_config_check_prints_the_effective_settings_without_secrets() -> None:
    result = run_check(
        {
            "POSTBOX_DATABASE_URL": "postgresql://app:hunter2@db/x",
            "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
            "POSTBOX_RDKAFKA_SASL_PASSWORD": "hunter2",
            "POSTBOX_STRIPE_SECRETS": "whsec_hunter2",
        }
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hunter2" not in result.stdout
    assert "rdkafka enable.idempotence = true" in result.stdout
    assert "stripe = Stripe" in result.stdout


def test_config_check_names_an_invalid_setting_and_fails() -> None:
    result = run_check(
        {
            "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
            "POSTBOX_DATABASE_URL": "postgresql://db/x",
            "POSTBOX_RDKAFKA_ACKS": "1",
            "POSTBOX_MARQETA_USERNAME": "u",
        }
    )
    assert result.returncode == 1
    assert "relay: INVALID: kafka-config acks=1" in result.stdout
    assert "webhook receiver: INVALID: POSTBOX_MARQETA_PASSWORD is required" in result.stdout


def test_liveness_options_fill_in_what_the_url_leaves_out() -> None:
    from relay.core.db import LIVENESS, liveness_options  # noqa: PLC0415

    assert liveness_options("postgresql://db/x") == LIVENESS
    chosen = liveness_options("postgresql://db/x?connect_timeout=3&keepalives_idle=60")
    assert "connect_timeout" not in chosen
    assert "keepalives_idle" not in chosen
    assert chosen["tcp_user_timeout"] == "20000"
