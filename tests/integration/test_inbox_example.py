"""The inbox example's own tests (postbox.inbox.example, the order projection the demo runs), written as a
service writes its handler tests: with the test harness (postbox.inbox.testing), no broker, a real
PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from postbox.inbox import example
from postbox.inbox.testing import InboxTester
from tests.support.servers import Servers

Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def tester(servers: Servers, schema: str, db: Conn) -> Iterator[InboxTester]:
    db.execute(
        "CREATE TABLE IF NOT EXISTS public.order_projection "
        "(order_id text PRIMARY KEY, total numeric, seq bigint NOT NULL)"
    )
    with InboxTester(example.inbox, servers.database_url, schema=schema) as harness:
        yield harness


def _projection(db: Conn, order: str) -> tuple[object, ...] | None:
    return db.execute(
        "SELECT total::text, seq FROM public.order_projection WHERE order_id = %s", (order,)
    ).fetchone()


def test_order_changes_are_projected_and_a_late_older_one_changes_nothing(
    tester: InboxTester, db: Conn
) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    first = tester.message("OrderChanged", {"order": order, "total": "9.99", "seq": 1})
    second = tester.message("OrderChanged", {"order": order, "total": "12.50", "seq": 2})
    late = tester.message("OrderChanged", {"order": order, "total": "9.99", "seq": 1})
    assert [d.status for d in tester.deliver(first, second)] == ["done", "done"]
    assert [d.status for d in tester.deliver(late)] == ["done"], "applied, and the version guard kept seq 2"
    assert _projection(db, order) == ("12.50", 2)


def test_a_redelivered_message_is_a_duplicate_and_runs_nothing(tester: InboxTester, db: Conn) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    message = tester.message("OrderChanged", {"order": order, "total": "1.00", "seq": 1})
    assert tester.deliver(message)[0].status == "done"
    db.execute("UPDATE public.order_projection SET total = 0 WHERE order_id = %s", (order,))
    assert tester.deliver(message)[0].status == "duplicate"
    assert _projection(db, order) == ("0", 1), "the handler did not run again"


def test_a_message_the_example_cannot_apply_is_parked_with_why(tester: InboxTester, db: Conn) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    broken = tester.message("OrderChanged", {"order": order, "seq": 1})  # no total
    unknown = tester.message("OrderPlaced", {"order": order})  # the example handles OrderChanged only
    parked = tester.deliver(broken, unknown)
    assert [(d.status, d.error) for d in parked] == [
        ("failed", "KeyError: 'total'"),
        ("failed", "Unhandled: no handler for event type 'OrderPlaced' and no fallback "
                   "(Inbox(unhandled='ignore') skips such)"),
    ]  # fmt: skip
    assert _projection(db, order) is None
