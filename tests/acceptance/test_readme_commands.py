"""The documented relay and inbox commands, exactly as written, deliver events to the example handler.

The commands are read out of the documentation (README.md and docs/, through tests/docs.py, which also
checks that every page showing one shows the same line, so the test follows the text wherever it is), run
by bash with only the environment the pages describe (`DATABASE_URL`, and `POSTBOX_*` for what the inbox
command leaves to the environment), against a database of their own on the test server, with
`broker:9092` standing for the test broker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postbox.relay.devstack.ports import free_port
from postbox.relay.outbox import enqueue
from tests import docs
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until


def readme_command(prefix: str) -> str:
    """The documentation's command line that starts with `prefix`, without its trailing comment: the same
    line on every page that shows it (README.md, docs/how-to/run-the-relay.md, ...)."""
    return docs.command(prefix)


@pytest.fixture
def database(servers: Servers) -> Iterator[str]:
    name = f"readme_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _as_url(make_conninfo(servers.database_url, dbname=name))
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def test_the_readme_relay_and_inbox_commands_apply_events_in_the_example_handler(
    servers: Servers, database: str
) -> None:
    migrate = readme_command("postbox migrate --database-url ")
    relay = readme_command("postbox relay run --database-url ").replace(
        "broker:9092", servers.kafka_bootstrap
    )
    consume = readme_command("postbox inbox consume --app postbox.inbox.example:inbox")
    assert "--event-type-header" not in relay, "the documented relay command takes the defaults"
    url = database
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO),  # this checkout's code, whatever the venv has installed
        "DATABASE_URL": url,
        "POSTBOX_DATABASE_URL": url,
        "POSTBOX_KAFKA_BOOTSTRAP": servers.kafka_bootstrap,
    }
    # Only so the relay does not fight a neighbour over the default 9400 (the inbox serves none by default).
    relay_env = {**env, "POSTBOX_METRICS_ADDRESS": f"127.0.0.1:{free_port()}"}
    subprocess.run(["bash", "-c", migrate], env=env, cwd=REPO, check=True, capture_output=True, timeout=60)
    with psycopg.connect(url, autocommit=True) as conn:
        # The table inbox/example.py documents.
        conn.execute(
            "CREATE TABLE order_projection (order_id text PRIMARY KEY, total numeric, seq bigint NOT NULL)"
        )
        orders = [f"order-{uuid.uuid4().hex[:6]}" for _ in range(5)]
        event_ids = []
        for seq in range(1, 31):
            order = orders[seq % 5]
            payload = {"order": order, "seq": seq, "total": seq * 10}
            event_ids.append(str(enqueue(conn, "order", order, "OrderChanged", payload)))

    logs = Path(f"/tmp/postbox-readme-{uuid.uuid4().hex[:6]}")
    logs.mkdir()
    children = [
        subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            env=command_env,
            cwd=REPO,
            stdout=(logs / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name, command, command_env in (("relay", relay, relay_env), ("inbox", consume, env))
    ]
    try:

        def projected() -> list[tuple[object, ...]]:
            with psycopg.connect(url) as conn:
                # Only this test's orders: the topic may hold earlier runs' events too.
                return conn.execute(
                    "SELECT order_id, seq FROM order_projection WHERE order_id = ANY(%s) ORDER BY order_id",
                    (orders,),
                ).fetchall()

        expected = sorted((order, max(s for s in range(1, 31) if orders[s % 5] == order)) for order in orders)
        wait_until(
            lambda: projected() == expected or any(c.poll() is not None for c in children),
            90,
            what="the example handler's projection",
        )
        assert all(c.poll() is None for c in children), _logs(logs)
        assert projected() == expected, _logs(logs)
        with psycopg.connect(url) as conn:
            states = conn.execute(
                "SELECT status, count(*) FROM postbox.inbox_message GROUP BY status"
            ).fetchall()
        assert states == [("done", 30)], states
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        codes = [child.wait(timeout=60) for child in children]
    assert codes == [0, 0], _logs(logs)


def _as_url(conninfo: str) -> str:
    """A libpq URL, as the documentation's $DATABASE_URL is."""
    parts = {k: str(v) for k, v in conninfo_to_dict(conninfo).items()}
    userinfo = parts.get("user", "postgres") + (f":{parts['password']}" if "password" in parts else "")
    host, port = parts.get("host", "127.0.0.1"), parts.get("port", "5432")
    return f"postgresql://{userinfo}@{host}:{port}/{parts['dbname']}"


def _logs(directory: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in directory.glob("*.log")
    )
