"""`postbox inbox serve --workers 2` on real servers: two receiver processes behind one port, supervised
by their parent, which serves one metrics port for both (inbox.webhooks.processes)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postbox.relay.devstack.ports import free_port
from tests.support.probes import http_get, metric_value
from tests.support.processes import ReceiverProcess
from tests.support.servers import Servers
from tests.support.waiting import wait_until
from tests.support.webhooks import stripe_body, stripe_headers

Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def receiver(servers: Servers, schema: str) -> Iterator[Any]:
    port = free_port()
    with ReceiverProcess(
        servers.database_url, schema, "--workers", "2", "--metrics-address", f"127.0.0.1:{port}"
    ) as process:
        process.metrics_port = port  # type: ignore[attr-defined]
        wait_until(lambda: len(process.serving_pids()) == 2, 30, what="both receiver processes")
        yield process


def send(receiver: Any, count: int, prefix: str) -> list[int]:
    bodies = [stripe_body(event_id=f"{prefix}_{i}") for i in range(count)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda b: receiver.post("stripe", b, stripe_headers(b))[0], bodies))


def accepted(receiver: Any) -> float:
    _, metrics = http_get(receiver.metrics_port, "/metrics")
    return metric_value(metrics, "postbox_webhook_requests_total", provider="stripe", outcome="accepted")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_two_processes_serve_one_port_and_one_scrape_counts_them_both(receiver: Any, db: Conn) -> None:
    assert send(receiver, 60, "evt_two") == [200] * 60
    assert db.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (60,)
    assert accepted(receiver) == 60, "the parent adds up both processes' counters"
    assert http_get(receiver.metrics_port, "/readyz") == (200, "ok\n")
    # Each process holds its own pool: both have connected to the database.
    backends = db.execute(
        "SELECT count(DISTINCT client_port) FROM pg_stat_activity WHERE application_name = 'postbox-webhooks'"
    ).fetchone()
    assert backends is not None
    assert int(str(backends[0])) >= 2


def test_a_killed_process_is_replaced_and_its_counts_are_kept(receiver: Any, db: Conn) -> None:
    assert send(receiver, 20, "evt_before") == [200] * 20
    victim = receiver.serving_pids()[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: victim not in receiver.serving_pids() and len(receiver.serving_pids()) == 2,
        30,
        what="the parent to start a new process",
    )
    assert "receiver_process_exited" in receiver.log()
    assert send(receiver, 20, "evt_after") == [200] * 20
    assert db.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (40,)
    assert accepted(receiver) == 40, "what the killed process counted still counts"
    wait_until(lambda: http_get(receiver.metrics_port, "/readyz")[0] == 200, 30, what="ready again")


def test_sigterm_stops_every_process_cleanly(receiver: Any) -> None:
    children = receiver.process_tree()[1:]  # the receivers and multiprocessing's resource tracker
    assert receiver.terminate() == 0
    wait_until(lambda: not any(alive(pid) for pid in children), 10, what="the processes to stop")


def test_a_parent_killed_outright_leaves_no_process_behind(receiver: Any) -> None:
    children = receiver.process_tree()[1:]
    receiver.kill()
    wait_until(lambda: not any(alive(pid) for pid in children), 15, what="the orphans to stop")
