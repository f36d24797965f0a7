"""Ordinary operator mistakes, made for real: the `postbox` CLI run as a process against the test servers
(and, for passwords, a PostgreSQL of the test's own that checks them), each answering with one line and
its documented exit code (docs/reference/exit-codes.md), never a traceback or a password; daemons stop on a
permanent misconfiguration and keep retrying a server that is down; librdkafka's lines reach the log as
limited JSON events; `postbox config check --connect` finds what the settings alone cannot show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg.conninfo import make_conninfo

from postbox.relay.core.kafka_logs import message_shape
from postbox.relay.core.migrate import load_migrations, migrate
from postbox.relay.devstack.ports import free_port
from postbox.relay.outbox import enqueue
from tests.support.processes import ChildProcess, relay_run_args, server_args
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import holds_for, wait_until

EX_UNAVAILABLE, EX_NOPERM, EX_CONFIG = 69, 77, 78


def postbox(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The real CLI, with only the environment given (no stray POSTBOX_* of the test run's own)."""
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(REPO),
            **(env or {}),
        },
        check=False,
        timeout=timeout,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *phrases: str) -> str:
    """The command failed with `code` and said so in one line on stderr, without a traceback."""
    said = result.stderr.strip()
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{said}"
    assert "Traceback" not in said, said
    assert len(said.splitlines()) == 1, said
    assert said.startswith("postbox: "), said
    for phrase in phrases:
        assert phrase in said, said
    return said


def url_with(database_url: str, **parts: str) -> str:
    return make_conninfo(database_url, **parts)


def unlistened_url() -> str:
    return f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"


@pytest.fixture
def fresh_name(servers: Servers) -> Iterator[str]:
    """A schema name nobody migrated into (dropped afterwards, should a test create it)."""
    name = f"t_unmigrated_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# -- one-shot commands -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["relay", "status"], ["inbox", "status"], ["relay", "requeue", "--all"], ["relay", "prune"]],
    ids=" ".join,
)
def test_an_unmigrated_schema_is_named_with_the_command_to_run(
    servers: Servers, fresh_name: str, command: list[str]
) -> None:
    result = postbox(*command, "--database-url", servers.database_url, "--schema", fresh_name)
    assert_one_line(
        result,
        EX_CONFIG,
        f'schema "{fresh_name}" is not migrated',
        f"run `postbox migrate --schema {fresh_name}`",
    )


def test_a_schema_older_than_this_postbox_says_which_migration_it_is_at(
    servers: Servers, fresh_name: str
) -> None:
    migrations = load_migrations()
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        migrate(conn, fresh_name, migrations[:1])  # the outbox of the first release: no log tables yet
    result = postbox("relay", "status", "--database-url", servers.database_url, "--schema", fresh_name)
    assert_one_line(
        result,
        EX_CONFIG,
        f'schema "{fresh_name}" is at migration 0001 and this postbox needs {migrations[-1].version:04d}',
        f"run `postbox migrate --schema {fresh_name}`",
    )


@pytest.mark.parametrize("command", [["migrate"], ["relay", "status"], ["inbox", "prune"]], ids=" ".join)
def test_a_database_that_is_down_is_unavailable(command: list[str]) -> None:
    result = postbox(*command, "--database-url", unlistened_url())
    assert_one_line(result, EX_UNAVAILABLE, "database unavailable:", "Connection refused")


def test_a_database_that_does_not_exist(servers: Servers) -> None:
    result = postbox(
        "inbox", "status", "--database-url", url_with(servers.database_url, dbname="no_such_db_x")
    )
    assert_one_line(result, EX_CONFIG, 'database "no_such_db_x" does not exist')


def test_a_role_that_does_not_exist(servers: Servers) -> None:
    url = url_with(servers.database_url, user="no_such_role_x")
    result = postbox("relay", "requeue", "--all", "--database-url", url)
    assert_one_line(result, EX_NOPERM, 'role "no_such_role_x" does not exist')


# The test servers trust every local connection (initdb --auth=trust in relay/devstack/postgres.py), so a
# password is never checked there. This server of the test's own checks them: scram-sha-256 for every role
# but the superuser the fixture sets it up with.
PASSWORD = "s3cret-Pa55"


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """A PostgreSQL whose pg_hba.conf asks for passwords; yields the URL of role `app`, without password."""
    from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir  # noqa: PLC0415

    folder = Path(tempfile.mkdtemp(prefix="postbox-hba-"))
    folder.chmod(0o755)  # the server runs as its own user
    hba = folder / "pg_hba.conf"
    hba.write_text(
        "local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
    )
    hba.chmod(0o644)
    server = LocalPostgres(find_bin_dir(), settings={"hba_file": str(hba)}).start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE app LOGIN PASSWORD '{PASSWORD}'")
        yield f"postgresql://app@127.0.0.1:{server.port}/postgres"
    finally:
        server.stop()


def test_the_password_server_does_check_passwords(password_server: str) -> None:
    """Without this, the wrong-password tests below could pass on a server that accepts anything."""
    right = password_server.replace("app@", f"app:{PASSWORD}@")
    with psycopg.connect(right) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("app",)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(password_server.replace("app@", "app:wrong@")).close()


@pytest.mark.parametrize("command", [["migrate"], ["relay", "status"]], ids=" ".join)
def test_a_wrong_password(password_server: str, command: list[str]) -> None:
    wrong = "Wr0ng-passw0rd"
    result = postbox(*command, "--database-url", password_server.replace("app@", f"app:{wrong}@"))
    said = assert_one_line(result, EX_NOPERM, 'password authentication failed for user "app"')
    assert wrong not in said + result.stdout


def test_no_password_where_one_is_needed(password_server: str) -> None:
    assert_one_line(
        postbox("relay", "status", "--database-url", password_server), EX_NOPERM, "no password supplied"
    )


# -- daemons ---------------------------------------------------------------------------------------------


def events(child: ChildProcess) -> list[dict[str, object]]:
    found = []
    for line in child.log().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def stops_with(child: ChildProcess, code: int, timeout: float = 45) -> dict[str, object]:
    """The daemon exits by itself with `code`, its last word the postbox_stopped event, no traceback."""
    try:
        returned = child.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {timeout}s (retrying forever?):\n{child.log()[-3000:]}"
        ) from None
    assert returned == code, child.log()[-3000:]
    assert "Traceback" not in child.log(), child.log()[-3000:]
    stopped = [e for e in events(child) if e.get("event") == "postbox_stopped"]
    assert len(stopped) == 1, child.log()[-3000:]
    assert stopped[0]["exit_code"] == code
    return stopped[0]


def relay_run(name: str, database_url: str, bootstrap: str, schema: str = "postbox") -> ChildProcess:
    return ChildProcess(
        f"operator-{name}-{uuid.uuid4().hex[:6]}",
        relay_run_args(database_url, bootstrap, schema, free_port()),
        log_level="info",
    )


def inbox_consume(
    name: str, database_url: str, bootstrap: str, schema: str = "postbox", topic: str | None = None
) -> ChildProcess:
    return ChildProcess(
        f"operator-{name}-{uuid.uuid4().hex[:6]}",
        [
            "inbox",
            "consume",
            "--app",
            "postbox.inbox.example:inbox",
            "--topics",
            topic or f"operator-{uuid.uuid4().hex[:6]}",
            *server_args(database_url, bootstrap, schema),
        ],
        log_level="info",
    )


def test_a_relay_stops_on_a_database_that_does_not_exist(servers: Servers) -> None:
    url = url_with(servers.database_url, dbname="no_such_db_relay")
    with relay_run("nodb", url, servers.kafka_bootstrap) as relay:
        stopped = stops_with(relay, EX_CONFIG)
    assert 'database "no_such_db_relay" does not exist' in str(stopped["error"])


def topic_with_a_record(bootstrap: str) -> str:
    """A new topic holding one record: the inbox consumer connects to its database for its first batch."""
    topic = f"operator-{uuid.uuid4().hex[:6]}"
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, b'{"order": "o-1"}', b"o-1", headers={"id": str(uuid.uuid4()), "eventType": "X"})
    assert producer.flush(30) == 0
    return topic


def test_an_inbox_consumer_stops_on_an_unmigrated_schema(servers: Servers, fresh_name: str) -> None:
    topic = topic_with_a_record(servers.kafka_bootstrap)
    with inbox_consume(
        "unmigrated", servers.database_url, servers.kafka_bootstrap, fresh_name, topic
    ) as consumer:
        stopped = stops_with(consumer, EX_CONFIG)
    assert f'schema "{fresh_name}" is not migrated' in str(stopped["error"])


def test_an_inbox_consumer_stops_on_a_role_that_does_not_exist(servers: Servers) -> None:
    topic = topic_with_a_record(servers.kafka_bootstrap)
    url = url_with(servers.database_url, user="no_such_role_inbox")
    with inbox_consume("norole", url, servers.kafka_bootstrap, topic=topic) as consumer:
        stopped = stops_with(consumer, EX_NOPERM)
    assert 'role "no_such_role_inbox" does not exist' in str(stopped["error"])


def test_a_relay_stops_on_a_wrong_password(password_server: str, servers: Servers) -> None:
    url = password_server.replace("app@", "app:Wr0ng-passw0rd@")
    with relay_run("password", url, servers.kafka_bootstrap) as relay:
        stopped = stops_with(relay, EX_NOPERM)
        assert "Wr0ng-passw0rd" not in relay.log()
    assert 'password authentication failed for user "app"' in str(stopped["error"])


def test_a_relay_stops_on_an_unmigrated_schema(servers: Servers, fresh_name: str) -> None:
    with relay_run("unmigrated", servers.database_url, servers.kafka_bootstrap, fresh_name) as relay:
        stopped = stops_with(relay, EX_CONFIG)
    assert f'schema "{fresh_name}" is not migrated' in str(stopped["error"])


def test_the_webhook_receiver_stops_at_start_on_a_database_that_does_not_exist(servers: Servers) -> None:
    """Its pool would answer 503 forever; a database that is merely down still lets it start (the pool
    reconnects by itself)."""
    url = url_with(servers.database_url, dbname="no_such_db_receiver")
    with ChildProcess(
        f"operator-serve-{uuid.uuid4().hex[:6]}",
        ["inbox", "serve", "--port", str(free_port()), "--database-url", url],
        env={"POSTBOX_WEBHOOK_STRIPE_SECRETS": "whsec_test"},
        log_level="info",
    ) as receiver:
        stopped = stops_with(receiver, EX_CONFIG)
    assert 'database "no_such_db_receiver" does not exist' in str(stopped["error"])


def running(child: ChildProcess) -> bool:
    """Whether `child` is still running; an exit fails the test at once, with the end of its log."""
    assert child.process.poll() is None, child.log()[-3000:]
    return True


def test_a_relay_keeps_retrying_a_database_that_is_down(servers: Servers) -> None:
    """Transient trouble is retried as before: the relay is still there, saying why it waits."""
    with relay_run("down", unlistened_url(), servers.kafka_bootstrap) as relay:
        wait_until(
            lambda: any(e.get("event") == "relay_database_unavailable" for e in events(relay)),
            30,
            what="relay_database_unavailable",
        )
        holds_for(lambda: running(relay), 3, what="the relay retrying, not exiting")
        assert relay.terminate() == 0


# -- librdkafka's lines --------------------------------------------------------------------------------


@pytest.mark.parametrize("daemon", ["relay", "inbox"])
def test_with_kafka_down_librdkafka_lines_are_limited_json_events(
    servers: Servers, schema: str, daemon: str
) -> None:
    down = f"127.0.0.1:{free_port()}"
    if daemon == "relay":
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            enqueue(conn, "order", "o-1", "OrderPlaced", {"id": 1}, schema=schema)  # something to produce
        child = relay_run("kafka-down", servers.database_url, down, schema)
    else:
        child = inbox_consume("kafka-down", servers.database_url, down, schema)
    with child:
        # librdkafka retries a refused broker many times a second: ten seconds of its lines, and the
        # daemon running throughout.
        holds_for(lambda: running(child), 10, what=f"the {daemon} running with Kafka down")
        assert child.terminate() == 0
        lines = child.log().splitlines()
    raw = [line for line in lines if not line.startswith("{")]
    assert raw == [], raw[:5]
    kafka = [e for e in events(child) if e.get("event") == "kafka_client_log"]
    assert kafka, "librdkafka's lines are logged, not dropped"
    per_message = Counter(message_shape(str(e["facility"]), str(e["message"])) for e in kafka)
    assert max(per_message.values()) <= 3, per_message  # the limit: 3 per distinct message per minute


# -- config check --------------------------------------------------------------------------------------


@pytest.fixture
def migrated(servers: Servers, fresh_name: str) -> str:
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        migrate(conn, fresh_name)
    return fresh_name


def check_env(servers: Servers, schema: str, **extra: str) -> dict[str, str]:
    return {
        "POSTBOX_DATABASE_URL": servers.database_url,
        "POSTBOX_KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
        "POSTBOX_SCHEMA": schema,
        **extra,
    }


@pytest.mark.parametrize(
    ("app", "said"),
    [
        ("no_such_module_x.handlers:inbox", "cannot import no_such_module_x"),
        ("postbox.inbox.example:no_such_object", "has no attribute 'no_such_object'"),
        ("postbox.inbox.example:project_order", "is a function, not a postbox.inbox.handlers.Inbox"),
    ],
)
def test_config_check_imports_the_inbox_app(servers: Servers, migrated: str, app: str, said: str) -> None:
    env = check_env(servers, migrated, POSTBOX_INBOX_APP=app, POSTBOX_INBOX_TOPICS="t")
    for connect in ([], ["--connect"]):  # the app needs no server: checked either way
        result = postbox("config", "check", "--service", "inbox", *connect, env=env)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"inbox: PROBLEM: --app (POSTBOX_INBOX_APP): '{app}'" in result.stdout, result.stdout
        assert said in result.stdout, result.stdout
        assert "Traceback" not in result.stdout + result.stderr


def test_config_check_connect_finds_an_unreachable_broker(servers: Servers, migrated: str) -> None:
    down = f"127.0.0.1:{free_port()}"
    env = check_env(servers, migrated, POSTBOX_KAFKA_BOOTSTRAP=down)
    result = postbox("config", "check", "--connect", "--timeout", "3", "--service", "relay", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line for line in result.stdout.splitlines() if "PROBLEM" in line]
    assert len(problems) == 1, result.stdout
    assert problems[0].startswith(f"relay: PROBLEM: kafka unreachable at {down}"), problems
    assert "Connection refused" in problems[0]
    assert f'database: reached; schema "{migrated}" at migration' in result.stdout


def test_config_check_connect_uses_the_kafka_credentials(servers: Servers, migrated: str) -> None:
    """SASL configured against a broker that speaks none: the check fails the way the relay would."""
    env = check_env(
        servers,
        migrated,
        POSTBOX_RDKAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
        POSTBOX_RDKAFKA_SASL_MECHANISMS="PLAIN",
        POSTBOX_RDKAFKA_SASL_USERNAME="svc",
        POSTBOX_RDKAFKA_SASL_PASSWORD="kafka-s3cret",
    )
    result = postbox("config", "check", "--connect", "--timeout", "3", "--service", "relay", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "relay: PROBLEM: kafka unreachable" in result.stdout
    assert "SASL" in result.stdout
    assert "kafka-s3cret" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("url_parts", "said"),
    [
        (
            {"dbname": "no_such_db_check"},
            'database refused the connection: database "no_such_db_check" does not exist',
        ),
        (
            {"user": "no_such_role_check"},
            'database refused the connection: role "no_such_role_check" does not exist',
        ),
    ],
)
def test_config_check_connect_finds_a_database_that_refuses(
    servers: Servers, migrated: str, url_parts: dict[str, str], said: str
) -> None:
    env = check_env(servers, migrated, POSTBOX_DATABASE_URL=url_with(servers.database_url, **url_parts))
    result = postbox("config", "check", "--connect", "--service", "relay", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"relay: PROBLEM: {said}" in result.stdout, result.stdout


def test_config_check_connect_finds_an_unmigrated_schema(servers: Servers, fresh_name: str) -> None:
    result = postbox("config", "check", "--connect", "--service", "relay", env=check_env(servers, fresh_name))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        f'relay: PROBLEM: schema "{fresh_name}" is not migrated: run `postbox migrate --schema {fresh_name}`'
        in result.stdout
    )


def test_config_check_names_a_misspelled_variable(servers: Servers, migrated: str) -> None:
    env = check_env(servers, migrated, POSTBOX_RELAY_BATCHSIZE="500")
    for connect in ([], ["--connect"]):
        result = postbox("config", "check", *connect, env=env)
        assert result.returncode == 1, result.stdout + result.stderr
        assert (
            "unknown variable POSTBOX_RELAY_BATCHSIZE: no postbox command reads it "
            "(did you mean POSTBOX_RELAY_BATCH_SIZE?)" in result.stdout.splitlines()
        ), result.stdout


def test_the_readme_config_check_command_passes_on_a_good_configuration(
    servers: Servers, migrated: str
) -> None:
    """The documented `postbox config check --connect` (docs/how-to/operate.md), exactly as written, on
    settings that are right."""
    from tests import docs  # noqa: PLC0415

    command = docs.command("postbox config check --connect", indented=True)
    env = check_env(
        servers,
        migrated,
        POSTBOX_INBOX_APP="postbox.inbox.example:inbox",
        POSTBOX_INBOX_TOPICS="outbox.event.order",
    )
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"HOME": os.environ.get("HOME", "/root"), "PYTHONPATH": str(REPO), **env},
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PROBLEM" not in result.stdout
    for service in ("relay", "inbox"):
        assert f"{service}: ok" in result.stdout.splitlines()
    assert result.stdout.count(f'database: reached; schema "{migrated}" at migration') == 2
    assert result.stdout.count("kafka: reached;") == 2
    assert "  app: postbox.inbox.example:inbox loaded (Inbox" in result.stdout
