"""What a service installs: the wheel, alone in a clean virtual environment, next to a service of its own that
has packages named `inbox` and `relay` (common names). The wheel's only top-level package is `postbox`, so
the service's packages are its own; a writer and a handler from the wheel move an event end to end through
the real PostgreSQL and Kafka, with the `postbox` command the wheel installs."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import uuid
import zipfile
from pathlib import Path

import psycopg
import pytest

from postbox.relay.devstack.ports import free_port
from tests.support.kafka import create_topic
from tests.support.processes import ChildProcess
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    [built] = out.glob("postbox_outbox-*.whl")
    return built


@pytest.fixture(scope="module")
def clean_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the wheel installed and nothing of the checkout: its python."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300)
    # The wheel's dependencies come from this test run's environment (no registry needed), added after the
    # install so pip saw an environment without postbox. Only the directory is added: the checkout's
    # editable-install .pth file there is not processed, so the checkout stays out of reach.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "dependencies-of-the-test-run.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_holds_one_package_named_postbox_with_its_sql(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    top = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top == {"postbox"}, top
    assert {
        "postbox/__init__.py",
        "postbox/py.typed",
        "postbox/relay/schemas/migrations/0001_outbox.sql",
        "postbox/relay/outbox/queries.sql",
        "postbox/inbox/queries.sql",
        "postbox/inbox/webhooks/queries.sql",
        "postbox/relay/devstack/kafka-pom.xml",
    } <= names
    [metadata] = [name for name in names if name.endswith(".dist-info/METADATA")]
    assert "Name: postbox-outbox\n" in archive.read(metadata).decode()


SERVICE_FILES = {
    # The service's own packages, named like postbox's folders.
    "inbox/__init__.py": 'OWNER = "the service"\n',
    "relay/__init__.py": 'OWNER = "the service"\n',
    "orders/__init__.py": "",
    "orders/handlers.py": """
import os

import inbox
import relay
from postbox import Inbox, Message

assert inbox.OWNER == relay.OWNER == "the service", (inbox, relay)

app = Inbox("wheel-test")


@app.handler("OrderChanged")
def record(tx, message: Message) -> None:
    table = os.environ["SEEN_TABLE"]
    tx.execute(
        f"INSERT INTO public.{table} (message_id, order_id) VALUES (%s, %s)",
        (message.message_id, message.payload["order"]),
    )
""",
    "write.py": """
import sys

import inbox
import postbox
import psycopg
import relay
from postbox import enqueue

assert inbox.OWNER == relay.OWNER == "the service", (inbox, relay)
assert postbox.__file__.startswith(sys.prefix), postbox.__file__  # the installed wheel, not a checkout
url, schema, aggregate_type, order = sys.argv[1:]
with psycopg.connect(url) as conn:  # commits on leaving the block
    event_id = enqueue(conn, aggregate_type, order, "OrderChanged", {"order": order}, schema=schema)
print(event_id)
""",
}


def test_a_service_with_its_own_inbox_and_relay_packages_writes_and_handles_through_the_wheel(
    servers: Servers, clean_python: Path, tmp_path: Path
) -> None:
    service = tmp_path / "service"
    for name, text in SERVICE_FILES.items():
        (service / name).parent.mkdir(parents=True, exist_ok=True)
        (service / name).write_text(text.lstrip())
    schema = f"w_{uuid.uuid4().hex[:10]}"
    table = f"seen_{uuid.uuid4().hex[:10]}"
    aggregate_type = f"wheel{uuid.uuid4().hex[:8]}"
    topic = f"outbox.event.{aggregate_type}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE public.{table} (message_id text PRIMARY KEY, order_id text NOT NULL)")
    postbox_script = clean_python.parent / "postbox"
    common = ["--database-url", servers.database_url, "--schema", schema]
    kafka = ["--kafka-bootstrap", servers.kafka_bootstrap]
    try:
        # The SQL comes from the wheel: nothing of the checkout is on this environment's path.
        migrated = subprocess.run(
            [str(postbox_script), "migrate", *common],
            capture_output=True,
            text=True,
            cwd=service,
            timeout=120,
            check=False,
        )
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        written = subprocess.run(
            [str(clean_python), "write.py", servers.database_url, schema, aggregate_type, "o-1"],
            capture_output=True,
            text=True,
            cwd=service,
            timeout=60,
            check=False,
        )
        assert written.returncode == 0, written.stdout + written.stderr
        event_id = written.stdout.strip()

        relay_args = ["relay", "run", *common, *kafka, "--metrics-address", f"127.0.0.1:{free_port()}"]
        # --app names the service's module as uvicorn's would: found from the directory it starts in.
        consume_args = [
            "inbox",
            "consume",
            "--app",
            "orders.handlers:app",
            "--topics",
            topic,
            *common,
            *kafka,
        ]
        env = {"SEEN_TABLE": table, "PYTHONPATH": ""}
        program = (str(postbox_script),)  # the installed script: its sys.path holds no current directory
        with (
            ChildProcess(f"wheel-relay-{schema}", relay_args, env, program=program, cwd=service) as relay,
            ChildProcess(f"wheel-inbox-{schema}", consume_args, env, program=program, cwd=service) as inbox,
        ):
            seen: list[tuple[object, ...]] = []
            with psycopg.connect(servers.database_url, autocommit=True) as conn:

                def handled() -> bool:
                    assert relay.process.poll() is None, relay.log()
                    assert inbox.process.poll() is None, inbox.log()
                    seen[:] = conn.execute(f"SELECT message_id, order_id FROM public.{table}").fetchall()
                    return bool(seen)

                wait_until(handled, 90, interval=0.2, what="the event handled through the wheel")
            assert seen == [(event_id, "o-1")], relay.log()[-3000:] + inbox.log()[-3000:]
            assert relay.terminate() == 0, relay.log()[-3000:]
            assert inbox.terminate() == 0, inbox.log()[-3000:]
    finally:
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS public.{table}")
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
