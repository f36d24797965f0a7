"""`async def` handlers and typed payloads through the real consumer, on real Kafka and PostgreSQL: each
message applied once, in the transaction that claimed it (an async handler's statements on the
AsyncConnection postbox gives it are in that transaction), with the retries, parking and requeue a `def`
handler has. Before this, an `async def` handler was recorded done and its body never ran."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg

from tests.support.kafka import create_topic, produce
from tests.support.processes import InboxProcess, inbox_cli
from tests.support.servers import Servers
from tests.support.waiting import wait_until

APP = "tests.apps.async_bank:inbox"
Conn = psycopg.Connection[tuple[object, ...]]


def _effects(db: Conn) -> dict[str, int]:
    rows = db.execute("SELECT message_id, count(*) FROM effects GROUP BY message_id").fetchall()
    return {str(m): int(str(c)) for m, c in rows}


def _statuses(db: Conn) -> dict[str, tuple[object, ...]]:
    rows = db.execute("SELECT message_id, status, attempts, error FROM inbox_message").fetchall()
    return {str(row[0]): tuple(row[1:]) for row in rows}


def test_async_sync_and_typed_handlers_each_apply_their_messages_once(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"async-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 2)
    kinds = ["AsyncDeposit", "SyncDeposit", "TypedDeposit", "RecordDeposit"]
    events = [
        (f"{kind}-{i}-{uuid.uuid4().hex[:6]}", kind, {"account": f"acct-{i % 3}", "amount": 10})
        for i in range(10)
        for kind in kinds
    ]
    hook_log = Path(f"/tmp/postbox-test-hooks-{uuid.uuid4().hex[:8]}")
    produce(servers.kafka_bootstrap, topic, events + events[:8])  # 8 sent twice
    with InboxProcess(
        servers.database_url,
        servers.kafka_bootstrap,
        schema,
        APP,
        [topic],
        env={"BANK_HOOK_LOG": str(hook_log)},
    ) as consumer:
        wait_until(lambda: len(_effects(bank)) == len(events), 60, what="every event applied")
        wait_until(lambda: hook_log.exists() and len(hook_log.read_text().split()) >= 40, 30, what="hooks")
        assert consumer.terminate() == 0
    assert set(_effects(bank).values()) == {1}, "no message applied twice"
    assert bank.execute("SELECT sum(balance) FROM accounts").fetchone() == (len(events) * 10,)
    assert {status for status, _, _ in _statuses(bank).values()} == {"done"}
    assert sorted(hook_log.read_text().split()) == sorted(m for m, _, _ in events), "the async hook ran"


def test_an_async_handler_that_fails_is_retried_and_parked_and_a_payload_of_the_wrong_shape_is_parked(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"async-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    poison = (f"poison-{uuid.uuid4().hex}", "AsyncPoison", {"account": "p", "amount": 1})
    misfit = (f"misfit-{uuid.uuid4().hex}", "TypedDeposit", {"account": "m", "amount": "lots"})
    record_misfit = (f"rmisfit-{uuid.uuid4().hex}", "RecordDeposit", {"account": "m", "amount": 1, "x": 2})
    before = [
        (f"b{i}-{uuid.uuid4().hex[:6]}", "AsyncDeposit", {"account": "a", "amount": 1}) for i in range(3)
    ]
    after = [
        (f"a{i}-{uuid.uuid4().hex[:6]}", "AsyncDeposit", {"account": "a", "amount": 1}) for i in range(3)
    ]
    produce(servers.kafka_bootstrap, topic, [*before, poison, misfit, record_misfit, *after], key="k")
    with InboxProcess(servers.database_url, servers.kafka_bootstrap, schema, APP, [topic]) as consumer:
        wait_until(lambda: len(_effects(bank)) == 6, 60, what="the messages around the failures applied")
        assert consumer.terminate() == 0
        assert "inbox_handler_retry" in consumer.log()
        parked_lines = [
            json.loads(line) for line in consumer.log().splitlines() if "inbox_message_parked" in line
        ]
    [poison_line] = [line for line in parked_lines if line["message_id"] == poison[0]]
    assert poison_line["level"] == "error"
    assert "Traceback (most recent call last)" in poison_line["exception"], (
        "the handler's traceback is logged"
    )
    assert "in async_poison" in poison_line["exception"]
    assert "'amount': 1" not in json.dumps(parked_lines), "and no payload with it"
    statuses = _statuses(bank)
    assert statuses[poison[0]] == ("failed", 3, "RuntimeError: this event can never be applied")
    assert poison[0] not in _effects(bank), "the async handler's writes were rolled back with its savepoint"
    status, attempts, error = statuses[misfit[0]]
    assert (status, attempts) == ("failed", 1), "a payload that does not decode is not retried"
    assert str(error).startswith("PayloadMismatch: payload is not a Deposit: 1 validation error"), error
    assert "amount" in str(error)
    status, attempts, error = statuses[record_misfit[0]]
    assert (status, attempts) == ("failed", 1)
    assert str(error).startswith("PayloadMismatch: payload is not a DepositRecord: "), error
    assert "'x'" in str(error), error


def test_requeue_runs_an_async_handler_for_a_parked_message(
    servers: Servers, schema: str, bank: Conn
) -> None:
    topic = f"async-{uuid.uuid4().hex[:8]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    later = (f"later-{uuid.uuid4().hex}", "AsyncLater", {})
    produce(servers.kafka_bootstrap, topic, [later])
    ready = Path(f"/tmp/postbox-test-ready-{uuid.uuid4().hex[:8]}")
    env = {"ASYNC_BANK_READY": str(ready)}
    with InboxProcess(
        servers.database_url, servers.kafka_bootstrap, schema, APP, [topic], env=env
    ) as consumer:
        wait_until(lambda: _statuses(bank).get(later[0], ("",))[0] == "failed", 60, what="parked")
        assert consumer.terminate() == 0
    ready.touch()
    base = ["requeue", "--app", APP, "--kafka-bootstrap", servers.kafka_bootstrap, "--all"]
    out = inbox_cli(servers, schema, *base, env=env).stdout
    assert "1 applied, 0 failed again" in out, out
    assert _statuses(bank)[later[0]][0] == "done"
    assert _effects(bank) == {later[0]: 1}
