import subprocess
import sys

import pytest

from postbox.relay.core.redact import MASK, redact, redact_url
from tests.support.repo import REPO


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("POSTBOX_WEBHOOK_STRIPE_SECRETS", "whsec_abc", MASK),
        ("POSTBOX_WEBHOOK_MARQETA_PASSWORD", "pw", MASK),
        ("POSTBOX_RDKAFKA_SASL_PASSWORD", "pw", MASK),
        ("rdkafka sasl.password", "pw", MASK),
        ("POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE", "/run/secrets/stripe", "/run/secrets/stripe"),
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
        [sys.executable, "-m", "postbox", "config", "check"],
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
            "POSTBOX_WEBHOOK_STRIPE_SECRETS": "whsec_hunter2",
        }
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hunter2" not in result.stdout
    assert "rdkafka enable.idempotence = true" in result.stdout
    assert "POSTBOX_WEBHOOK_STRIPE_SECRETS = ********  (env POSTBOX_WEBHOOK_STRIPE_SECRETS)" in result.stdout
    assert (
        "POSTBOX_DATABASE_URL = postgresql://app:********@db/x  (env POSTBOX_DATABASE_URL)" in result.stdout
    )
    assert "POSTBOX_RELAY_BATCH_SIZE = 1000 (queue) / 4000 (log)  (default)" in result.stdout
    assert "inbox: not configured (--app (POSTBOX_INBOX_APP): required)" in result.stdout


def test_config_check_names_an_invalid_setting_and_fails() -> None:
    result = run_check(
        {
            "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
            "POSTBOX_DATABASE_URL": "postgresql://db/x",
            "POSTBOX_RDKAFKA_ACKS": "1",
            "POSTBOX_WEBHOOK_MARQETA_USERNAME": "u",
        }
    )
    assert result.returncode == 1
    assert "relay: INVALID: kafka-config acks=1" in result.stdout
    assert (
        "receiver: INVALID: --marqeta-password (POSTBOX_WEBHOOK_MARQETA_PASSWORD): required" in result.stdout
    )


def test_liveness_options_fill_in_what_the_url_leaves_out() -> None:
    from postbox.relay.core.db import LIVENESS, liveness_options  # noqa: PLC0415

    assert liveness_options("postgresql://db/x") == LIVENESS
    chosen = liveness_options("postgresql://db/x?connect_timeout=3&keepalives_idle=60")
    assert "connect_timeout" not in chosen
    assert "keepalives_idle" not in chosen
    assert chosen["tcp_user_timeout"] == "20000"


def test_config_check_masks_key_material_odd_passwords_and_oauth_secrets(tmp_path: object) -> None:
    from pathlib import Path  # noqa: PLC0415

    url_file = Path(str(tmp_path)) / "db-url"
    url_file.write_text("postgresql://app:hun#ter2@db/x?sslmode=require\n")
    result = run_check(
        {
            "POSTBOX_DATABASE_URL_FILE": str(url_file),
            "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
            "POSTBOX_RDKAFKA_SSL_KEY_PEM": (
                "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADAN\n-----END PRIVATE KEY-----"
            ),
            "POSTBOX_RDKAFKA_SASL_OAUTHBEARER_CONFIG": "principal=svc clientId=abc clientSecret=s3cr3t-oauth",
        }
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for secret in ("hun#ter2", "ter2", "MIIEvQ", "s3cr3t-oauth"):
        assert secret not in result.stdout, secret
    assert (
        "POSTBOX_DATABASE_URL = postgresql://app:********@db/x?sslmode=require"
        "  (env POSTBOX_DATABASE_URL_FILE)" in result.stdout
    )


def test_an_empty_secret_file_fails_the_check_naming_it(tmp_path: object) -> None:
    from pathlib import Path  # noqa: PLC0415

    empty = Path(str(tmp_path)) / "stripe"
    empty.write_text("\n")
    result = run_check(
        {
            "POSTBOX_DATABASE_URL": "postgresql://db/x",
            "POSTBOX_KAFKA_BOOTSTRAP": "k:9092",
            "POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE": str(empty),
        }
    )
    assert result.returncode == 1, result.stdout
    assert "POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE=" in result.stdout
    assert "the secret is empty" in result.stdout


def test_a_malformed_database_url_is_refused_without_showing_its_password() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "postbox", "relay", "run", "--kafka-bootstrap", "k:9092"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "POSTBOX_DATABASE_URL": "postgresql://app:hun%zzter2@db/x"},
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "database-url: not a valid PostgreSQL URL" in result.stderr
    assert "hun%zzter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_a_metrics_port_already_taken_is_a_message_naming_the_setting() -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "postbox",
                "relay",
                "run",
                "--database-url",
                "postgresql://127.0.0.1:1/x",
                "--kafka-bootstrap",
                "127.0.0.1:1",
                "--metrics-address",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin"},
            check=False,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"--metrics-address 127.0.0.1:{port} (POSTBOX_METRICS_ADDRESS) cannot be served" in result.stderr
    assert "Traceback" not in result.stderr
