"""The pure parts of "operator errors": an exception to one line and an exit code, the librdkafka log
limit, and the names of variables no command reads. The connection errors here carry the texts libpq and
PostgreSQL 18 really produce (copied from the servers; tests/integration/test_operator_errors.py gets
them from the servers themselves)."""

from __future__ import annotations

import psycopg
import pytest
import structlog

from postbox.relay.core.config_check import known_variables, unknown_variables
from postbox.relay.core.kafka_logs import KafkaLogAdapter, LogLimiter, message_shape
from postbox.relay.core.migrate import MigrationError
from postbox.relay.core.operator_errors import (
    EX_CONFIG,
    EX_NOPERM,
    EX_UNAVAILABLE,
    OperatorError,
    SchemaState,
    explain,
    permanent_connect_failure,
)
from postbox.relay.outbox.settings import MigrateSettings, RelaySettings

AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '


def connect_error(text: str) -> psycopg.OperationalError:
    """What psycopg raises when a connect fails: an OperationalError with no SQLSTATE, only libpq's text."""
    return psycopg.OperationalError(AT + text)


@pytest.mark.parametrize(
    ("text", "code", "says"),
    [
        ('FATAL:  database "shop" does not exist', EX_CONFIG, 'database "shop" does not exist'),
        ('FATAL:  role "ghost" does not exist', EX_NOPERM, 'role "ghost" does not exist'),
        (
            'FATAL:  password authentication failed for user "app"',
            EX_NOPERM,
            'password authentication failed for user "app"',
        ),
        ("fe_sendauth: no password supplied", EX_NOPERM, "no password supplied"),
        (
            'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "app", database "shop", no encryption',
            EX_NOPERM,
            "no pg_hba.conf entry",
        ),
        ('FATAL:  role "app" is not permitted to log in', EX_NOPERM, "not permitted to log in"),
    ],
)
def test_a_refused_connection_is_one_line_and_stops_a_daemon(text: str, code: int, says: str) -> None:
    exc = connect_error(text)
    found = explain(exc)
    assert found is not None
    assert found.exit_code == code
    assert found.message.startswith("database refused the connection: ")
    assert says in found.message
    assert "\n" not in found.message
    assert permanent_connect_failure(exc)


@pytest.mark.parametrize(
    "text",
    [
        "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?",
        "FATAL:  sorry, too many clients already",
        "FATAL:  the database system is starting up",
        "timeout expired",
    ],
)
def test_a_server_down_or_busy_is_unavailable_and_retried(text: str) -> None:
    exc = connect_error(text)
    found = explain(exc)
    assert found is not None
    assert found.exit_code == EX_UNAVAILABLE
    first = text.splitlines()[0]
    # The server's own words when it answered; else libpq's, with the host and port it tried.
    said = first.removeprefix("FATAL:  ") if first.startswith("FATAL:") else AT.split(": ", 1)[1] + first
    assert found.message == f"database unavailable: {said}"
    assert not permanent_connect_failure(exc)


def test_a_name_that_does_not_resolve_is_unavailable() -> None:
    exc = psycopg.OperationalError(
        "failed to resolve host 'db.internal': [Errno -2] Name or service not known"
    )
    found = explain(exc)
    assert found is not None
    assert found.exit_code == EX_UNAVAILABLE
    assert "db.internal" in found.message


def test_server_side_sqlstates_map_too() -> None:
    assert explain(psycopg.errors.InvalidPassword('password authentication failed for user "app"')) == (
        OperatorError('database refused the connection: password authentication failed for user "app"', 77)
    )
    assert explain(psycopg.errors.InvalidCatalogName('database "shop" does not exist')) == OperatorError(
        'database refused: database "shop" does not exist', EX_CONFIG
    )
    assert explain(
        psycopg.errors.InsufficientPrivilege("permission denied for table outbox")
    ) == OperatorError("database refused: permission denied for table outbox", EX_NOPERM)
    found = explain(psycopg.errors.AdminShutdown("terminating connection due to administrator command"))
    assert found is not None
    assert found.exit_code == EX_UNAVAILABLE


def test_the_password_never_reaches_the_line() -> None:
    exc = connect_error('FATAL:  database "hunter2db" does not exist')
    found = explain(exc, secrets=["hunter2"])
    assert found is not None
    assert "hunter2" not in found.message


MISSING = psycopg.errors.UndefinedTable('relation "outbox" does not exist')


def test_an_unmigrated_schema_is_named_with_the_command_to_run() -> None:
    state = SchemaState("billing", applied=None, latest=9)
    assert explain(MISSING, schema="billing", state=state) == OperatorError(
        'schema "billing" is not migrated (relation "outbox" does not exist): '
        "run `postbox migrate --schema billing`",
        EX_CONFIG,
    )


def test_a_schema_behind_this_postbox_says_how_far() -> None:
    found = explain(MISSING, schema="billing", state=SchemaState("billing", applied=5, latest=9))
    assert found == OperatorError(
        'schema "billing" is at migration 0005 and this postbox needs 0009 (relation "outbox" does not '
        "exist): run `postbox migrate --schema billing`",
        EX_CONFIG,
    )


def test_a_schema_ahead_of_this_postbox_says_upgrade() -> None:
    found = explain(MISSING, schema="billing", state=SchemaState("billing", applied=12, latest=9))
    assert found is not None
    assert "newer than this postbox" in found.message
    assert found.message.endswith("upgrade postbox")


def test_a_missing_object_in_a_current_schema_is_a_bug_and_keeps_its_traceback() -> None:
    assert explain(MISSING, schema="billing", state=SchemaState("billing", applied=9, latest=9)) is None


def test_without_the_schema_state_the_line_still_says_to_migrate() -> None:
    for exc in (MISSING, psycopg.errors.UndefinedFunction("function outbox_tick() does not exist")):
        found = explain(exc, schema="billing")
        assert found is not None
        assert found.exit_code == EX_CONFIG
        assert "run `postbox migrate --schema billing`" in found.message


def test_anything_else_is_not_an_operator_error() -> None:
    assert explain(ValueError("a bug")) is None
    assert explain(psycopg.errors.UniqueViolation("duplicate key")) is None
    assert explain(MigrationError("migration 0003_x was changed")) == OperatorError(
        "migration refused: migration 0003_x was changed", EX_CONFIG
    )


# -- librdkafka's lines ------------------------------------------------------------------------------

LINE = "[thrd:k:9092/bootstrap]: k:9092/bootstrap: Connect to ipv4#10.0.0.1:9092 failed: Connection refused"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_repeats_of_a_message_are_let_through_up_to_the_burst_then_counted() -> None:
    clock = Clock()
    limiter = LogLimiter(burst=3, interval=60, clock=clock)
    key = message_shape("FAIL", LINE)
    assert [limiter.admit(key) for _ in range(5)] == [0, 0, 0, None, None]
    clock.now += 59
    assert limiter.admit(key) is None
    clock.now += 1  # a new window: the next line carries the count of those held back
    assert limiter.admit(key) == 3
    assert limiter.admit(key) == 0


def test_a_count_is_reported_even_when_its_message_never_comes_back() -> None:
    clock = Clock()
    limiter = LogLimiter(burst=1, interval=10, clock=clock)
    key = message_shape("FAIL", LINE)
    limiter.admit(key)
    limiter.admit(key)
    limiter.admit(key)
    assert limiter.overdue() == []
    clock.now += 10
    assert limiter.overdue() == [(key, 2)]
    assert limiter.overdue() == []


def test_distinct_messages_have_limits_of_their_own_and_timings_do_not_make_a_message_distinct() -> None:
    limiter = LogLimiter(burst=1, interval=60, clock=Clock())
    assert message_shape("FAIL", LINE + " (after 0ms in state CONNECT)") == message_shape(
        "FAIL", LINE + " (after 1012ms in state CONNECT, 5 identical error(s) suppressed)"
    )
    assert limiter.admit(message_shape("FAIL", LINE)) == 0
    assert limiter.admit(message_shape("FAIL", "1/1 brokers are down")) == 0
    assert limiter.admit(message_shape("FAIL", LINE)) is None


def test_the_adapter_turns_librdkafka_lines_into_limited_structlog_events() -> None:
    clock = Clock()
    adapter = KafkaLogAdapter(LogLimiter(burst=2, interval=60, clock=clock))
    with structlog.testing.capture_logs() as events:
        for ms in range(20):  # what confluent_kafka calls, with librdkafka's timing changing each time
            adapter.log(
                40, "%s [%s] %s", "FAIL", "rdkafka#producer-1", f"{LINE} (after {ms}ms in state CONNECT)"
            )
        clock.now += 60
        adapter.log(40, "%s [%s] %s", "FAIL", "rdkafka#producer-1", LINE)
    assert [e["event"] for e in events] == [
        "kafka_client_log",
        "kafka_client_log",
        "kafka_client_log_suppressed",
        "kafka_client_log",
    ]
    assert events[0]["facility"] == "FAIL"
    assert events[0]["client"] == "rdkafka#producer-1"
    assert events[0]["log_level"] == "error"
    assert events[2]["suppressed"] == 18
    assert "suppressed" not in events[3]  # the count was reported once, by the overdue event


# -- variables no command reads ------------------------------------------------------------------------


def test_a_misspelled_variable_is_named_with_a_suggestion() -> None:
    known = known_variables([RelaySettings, MigrateSettings])
    environ = {
        "POSTBOX_RELAY_BATCHSIZE": "5",
        "POSTBOX_RELAY_BATCH_SIZE": "5",
        "POSTBOX_DATABASE_URL_FILE": "/run/secrets/db",  # a secret's file form
        "POSTBOX_LEASE_TTL": "3",  # an earlier name, still read (with its own warning)
        "POSTBOX_RDKAFKA_SASL_USERNAME": "u",  # a family
        "POSTBOX_WHATEVER_THIS_IS": "x",
        "HOME": "/root",
    }
    assert unknown_variables(environ, known, ["POSTBOX_RDKAFKA_"]) == [
        "unknown variable POSTBOX_RELAY_BATCHSIZE: no postbox command reads it "
        "(did you mean POSTBOX_RELAY_BATCH_SIZE?)",
        "unknown variable POSTBOX_WHATEVER_THIS_IS: no postbox command reads it",
    ]


def test_a_generic_webhook_providers_variables_are_known_once_it_is_named() -> None:
    from postbox.relay.cli import _every_settings_class, _generic_provider_families  # noqa: PLC0415

    known = known_variables(_every_settings_class())
    environ = {"POSTBOX_WEBHOOK_GENERIC": "acme,big-co", "POSTBOX_WEBHOOK_ACME_SECRETS": "s"}
    environ |= {"POSTBOX_WEBHOOK_BIG_CO_ENCODING": "hex", "POSTBOX_WEBHOOK_OTHER_SECRETS": "s"}
    assert unknown_variables(environ, known, _generic_provider_families(environ)) == [
        "unknown variable POSTBOX_WEBHOOK_OTHER_SECRETS: no postbox command reads it "
        "(did you mean POSTBOX_WEBHOOK_STRIPE_SECRETS?)"
    ]
