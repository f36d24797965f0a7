"""Every example in examples/, run exactly as examples/README.md says, writes its order and the order's
OrderChanged event in one transaction: the order row, and exactly one outbox row with the aggregate type,
aggregate id, event type and payload the inbox example projects, written by the transaction that wrote
the order (the row's `txid` is the order's `xmin`).

The commands are read out of examples/README.md (so the test follows the text; the documentation, in
docs/how-to/write-events.md, and each example's own header must show the same lines) and run by bash with only
the environment it describes: `DATABASE_URL` (the test server) and `POSTBOX_SCHEMA` (the test's freshly
migrated schema). The FastAPI app is served by the documented uvicorn command on a free port and called with
the documented request; an order the database refuses answers 422 and writes no event. The Django example runs
on Django's psycopg 3 backend and, with psycopg hidden from Django's backend, on psycopg2.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from postbox.relay.devstack.ports import free_port
from tests import docs
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until

EXAMPLES = REPO / "examples"
README = (EXAMPLES / "README.md").read_text()
DOCUMENTATION = docs.text()  # README.md and every page under docs/
PLACED = re.compile(r"order (\S+) placed, event (\S+)")


def documented(prefix: str) -> str:
    """examples/README.md's command line that starts with `prefix`, without its trailing comment (and the
    same line in the documentation, which shows each command too)."""
    for line in README.splitlines():
        if line.startswith(prefix):
            command = line.split("  #", 1)[0].strip()
            assert command in DOCUMENTATION, (
                f"the documentation does not show {command!r} as examples/README.md does"
            )
            return command
    raise AssertionError(f"examples/README.md has no command starting {prefix!r}")


@pytest.fixture
def env(servers: Servers, schema: str) -> dict[str, str]:
    return {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python, uvicorn: the venv's
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO),  # this checkout's code, whatever the venv has installed
        "DATABASE_URL": servers.database_url,
        "POSTBOX_SCHEMA": schema,
    }


@pytest.fixture
def placed(servers: Servers) -> Iterator[list[str]]:
    """The ids of the orders a test placed, deleted from the shared `public.orders` afterwards."""
    ids: list[str] = []
    yield ids
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('public.orders')").fetchone() != (None,):
            conn.execute("DELETE FROM public.orders WHERE id = ANY(%s)", (ids,))


def run(command: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def events(servers: Servers, schema: str) -> list[tuple[object, ...]]:
    """Every row of the test's outbox: event id, aggregate type and id, event type, payload, and the
    writing transaction's id as an xid (what an order row's xmin is)."""
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        query = sql.SQL(
            "SELECT event_id::text, aggregate_type, aggregate_id, event_type, payload, xid(txid)::text "
            "FROM {}.outbox ORDER BY id"
        ).format(sql.Identifier(schema))
        return conn.execute(query).fetchall()


def assert_written_together(servers: Servers, schema: str, order_id: str, event_id: str) -> None:
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        order = conn.execute(
            "SELECT total::text, version, xmin::text FROM public.orders WHERE id = %s", (order_id,)
        ).fetchone()
    assert order is not None, f"no order {order_id}"
    total, version, xmin = order
    assert (total, version) == ("9.99", 1)
    payload = {"order": order_id, "total": "9.99", "seq": 1}
    assert events(servers, schema) == [(event_id, "order", order_id, "OrderChanged", payload, xmin)]


def assert_the_file_says(path: str, command: str) -> None:
    assert command in (EXAMPLES / path).read_text(), (
        f"{path} documents another command than examples/README.md"
    )


def place(command: str, env: dict[str, str], placed: list[str]) -> tuple[str, str, str]:
    """Runs a documented command that places one order: (order id, event id, its whole output)."""
    output = run(command, env)
    found = PLACED.search(output)
    assert found is not None, output
    placed.append(found[1])
    return found[1], found[2], output


def test_the_psycopg_example_writes_the_order_and_its_event_in_one_transaction(
    servers: Servers, schema: str, env: dict[str, str], placed: list[str]
) -> None:
    command = documented("python examples/psycopg_script/place_order.py ")
    assert_the_file_says("psycopg_script/place_order.py", command)
    order_id, event_id, _ = place(command, env, placed)
    assert_written_together(servers, schema, order_id, event_id)


def test_the_psql_example_writes_the_order_and_its_event_in_one_transaction_through_the_sql_api(
    servers: Servers, schema: str, env: dict[str, str], placed: list[str]
) -> None:
    command = documented('psql "$DATABASE_URL" ')
    assert_the_file_says("psql/place_order.sql", command)
    order_id, event_id, _ = place(command, env, placed)
    assert_written_together(servers, schema, order_id, event_id)


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_the_django_example_writes_the_order_and_its_event_in_one_atomic_block_on_either_driver(
    servers: Servers, schema: str, env: dict[str, str], placed: list[str], driver: str, tmp_path: Path
) -> None:
    command = documented("python examples/django_project/manage.py place_order ")
    assert_the_file_says("django_project/shop/management/commands/place_order.py", command)
    if driver == "psycopg2":
        # Django's backend takes psycopg when it can import it, psycopg2 otherwise; postbox itself needs
        # psycopg, so it is hidden only while the backend loads (sitecustomize runs before manage.py).
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\n"
            'sys.modules["psycopg"] = None\n'
            "import django.db.backends.postgresql.base\n"
            'del sys.modules["psycopg"]\n'
        )
        env = {**env, "PYTHONPATH": f"{tmp_path}:{env['PYTHONPATH']}"}
    order_id, event_id, output = place(command, env, placed)
    assert re.search(rf"\(Django [\d.]+ on {driver} [\d.]+\)$", output.strip()), output
    assert_written_together(servers, schema, order_id, event_id)


def test_the_fastapi_example_writes_the_order_and_its_event_in_one_transaction_and_a_refused_order_neither(
    servers: Servers, schema: str, env: dict[str, str], placed: list[str], tmp_path: Path
) -> None:
    serve = documented("uvicorn --app-dir examples/fastapi_sqlalchemy ")
    request = documented("curl -s -X POST localhost:8000/orders ")
    assert_the_file_says("fastapi_sqlalchemy/orders_api.py", serve)
    assert "--port 8000" in serve, "the test serves the app on a free port instead"
    port = free_port()
    words = shlex.split(request)
    url = "http://" + words[words.index("-X") + 2].replace("localhost:8000", f"127.0.0.1:{port}")
    header_name, header_value = words[words.index("-H") + 1].split(": ", 1)
    body = words[words.index("-d") + 1]

    def post(data: str) -> tuple[int, dict[str, str]]:
        sent = urllib.request.Request(url, data=data.encode(), headers={header_name: header_value})
        try:
            with urllib.request.urlopen(sent, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    log = tmp_path / "uvicorn.log"
    with log.open("wb") as output:
        app = subprocess.Popen(
            ["bash", "-c", f"exec {serve.replace('--port 8000', f'--port {port}')}"],
            env=env,
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening() -> bool:
            assert app.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_until(listening, 60, what="the FastAPI example's port")
        status, answer = post(body)
        assert status == 201, (status, answer)
        placed.append(answer["order"])
        assert_written_together(servers, schema, answer["order"], answer["event"])

        # Refused by the table's CHECK when the session flushes the order, which is before enqueue_async's
        # statement runs: the error path writes nothing. (An event rolled back after it was written, through
        # the same AsyncSession on asyncpg, is tests/integration/test_writers.py's.)
        status, answer = post(body.replace('"9.99"', '"-1.00"'))
        assert status == 422, (status, answer)
        assert "orders_total_check" in answer["detail"]
        assert len(events(servers, schema)) == 1, "the refused order wrote no event"
    finally:
        if app.poll() is None:
            app.send_signal(signal.SIGTERM)
        code = app.wait(timeout=30)
    # uvicorn shuts down cleanly, then re-raises the SIGTERM it caught (its server.py), so it dies of it
    assert code in {0, -signal.SIGTERM}, log.read_text()
    assert "Finished server process" in log.read_text()
