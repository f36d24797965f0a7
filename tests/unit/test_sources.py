"""The seam between the relay daemon and where its batches come from, without servers: the records both
reading statements return (by name), each source's default batch size, what a page of each says."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.metrics import RelayMetrics
from postbox.relay.outbox.outcome import DELIVERED, Delivery, RowState, decide
from postbox.relay.outbox.routing import OutboxRow
from postbox.relay.outbox.settings import LOG_BATCH_ROWS, QUEUE_BATCH_ROWS, RelaySettings
from postbox.relay.outbox.sources.base import RECORD_COLUMNS, BatchSource, OutboxRecord, outbox_records
from postbox.relay.outbox.sources.choice import make_source
from postbox.relay.outbox.sources.log import LogSource, WindowPage
from postbox.relay.outbox.sources.log_cursors import Cursor
from postbox.relay.outbox.sources.log_reader import LogPage
from postbox.relay.outbox.sources.queue import ClaimedPage, Claimer, QueueSource

CLAIMER = Claimer("relay-1", 7, delete_on_publish=False)


def settings(**overrides: object) -> RelaySettings:
    return RelaySettings(database_url="postgresql://x", kafka_bootstrap="k:9092", **overrides)  # type: ignore[arg-type]


def source(mode: str, given: RelaySettings) -> BatchSource:
    return make_source(
        mode,
        given,
        CLAIMER,
        tick_conn=lambda: pytest.fail("no tick is taken here"),
        tick_lock=threading.Lock(),
        metrics=RelayMetrics(CollectorRegistry()),
    )


def record(**overrides: Any) -> OutboxRecord:
    fields: dict[str, Any] = {
        "id": 11,
        "event_id": "0b7e0f9c-0000-4000-8000-000000000001",
        "aggregate_type": "order",
        "aggregate_id": "o-1",
        "event_type": "order.placed",
        "payload": '{"total": 3}',
        "payload_bytes": None,
        "headers": '{"h": "v"}',
        "topic": None,
        "shard": 5,
        "created_epoch": 1.5,
        "size": 42,
        "claimed_rows": 3,
    }
    fields.update(overrides)
    return OutboxRecord(**fields)


def test_a_record_and_a_row_name_the_same_fields_in_the_same_order() -> None:
    assert (*OutboxRow._fields, "claimed_rows") == RECORD_COLUMNS
    given = record()
    row = given.row({"h": "v"})
    for name in OutboxRow._fields:
        expected = {"h": "v"} if name == "headers" else getattr(given, name)
        assert getattr(row, name) == expected, name


def test_a_reading_statement_whose_columns_differ_by_name_is_refused() -> None:
    def cursor(*names: str) -> Any:
        return SimpleNamespace(description=[SimpleNamespace(name=n) for n in names])

    make = outbox_records(cursor(*RECORD_COLUMNS))
    assert make(tuple(record())) == record()
    swapped = list(RECORD_COLUMNS)
    swapped[2], swapped[3] = swapped[3], swapped[2]  # aggregate_id where aggregate_type should be
    with pytest.raises(RuntimeError, match="returned columns"):
        outbox_records(cursor(*swapped))
    with pytest.raises(RuntimeError, match="returned columns"):
        outbox_records(cursor(*RECORD_COLUMNS[:-1]))


def test_each_source_takes_its_own_batch_size_unless_one_is_given() -> None:
    assert source("queue", settings()).rows_per_batch == QUEUE_BATCH_ROWS
    assert source("log", settings()).rows_per_batch == LOG_BATCH_ROWS
    assert source("queue", settings(batch_size=50)).rows_per_batch == 50
    assert source("log", settings(batch_size=50)).rows_per_batch == 50
    assert isinstance(source("queue", settings()), QueueSource)
    assert isinstance(source("log", settings()), LogSource)
    with pytest.raises(ValueError, match="no source reads an outbox in mode 'auto'"):
        source("auto", settings())


def test_only_a_page_of_the_log_is_read_past() -> None:
    claimed = ClaimedPage([record(claimed_rows=5)], CLAIMER)
    assert (claimed.claimed, claimed.read_past) == (5, False)
    log_source = source("log", settings())
    assert isinstance(log_source, LogSource)
    window = WindowPage([record()], LogPage([], complete=True, stored=[]), log_source._reader)
    assert (window.claimed, window.read_past) == (3, True)


def test_a_page_across_groups_gives_each_group_only_its_own_shards_settlement() -> None:
    """Exactly-once: a lane's page spans its groups, and each group's transaction carries what the batch
    writes in that group's shards alone: a group read back after a lost commit writes nothing of another
    group's, whose own transaction may have been aborted."""
    rows = [record(id=11, shard=5, aggregate_id="a"), record(id=12, shard=9, aggregate_id="b")]
    rows.append(record(id=13, shard=10, aggregate_id="c"))
    fates = [DELIVERED, Delivery(Disposition.PARK, "too large"), DELIVERED]
    outcome = decide([11, 12, 13], ["a", "b", "c"], fates)
    log_source = source("log", settings())
    assert isinstance(log_source, LogSource)
    cursors = [Cursor(5, 1, 2), Cursor(9, 1, 2), Cursor(10, 1, 2)]
    window = WindowPage(rows, LogPage(cursors, complete=True, stored=cursors), log_source._reader)
    settlements = window.settlements([0, 1, 2], outcome)
    first, second = settlements[0], settlements[1]
    assert (first.group, second.group) == (0, 1)
    assert [m.shard for m in first.moves] == [5]
    assert first.parked == ()
    assert [m.shard for m in second.moves] == [9, 10]
    assert [(o.row_id, o.state) for o in second.parked] == [(12, RowState.FAILED)]
    assert settlements[2].moves == ()
    assert window.settlements([1], outcome).keys() == {1}  # only the groups asked for

    claimed = ClaimedPage(rows, CLAIMER).settlements([0, 1], outcome)
    assert [o.row_id for o in claimed[0].marked] == [11]
    assert [o.row_id for o in claimed[1].marked] == [12, 13]


def test_every_module_that_names_a_sql_file_finds_it() -> None:
    """A module moved to another folder keeps reading its SQL (log_reader.py once looked for queries.sql
    beside itself after its move into sources/, and every log-mode read failed)."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import postbox.inbox  # noqa: PLC0415
    import postbox.relay  # noqa: PLC0415

    checked = []
    for package in (postbox.relay, postbox.inbox):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            queries = getattr(importlib.import_module(module.name), "QUERIES", None)
            if isinstance(queries, Path):
                assert queries.is_file(), f"{module.name}.QUERIES: {queries} does not exist"
                checked.append(module.name)
    assert "postbox.relay.outbox.sources.log_reader" in checked
    assert "postbox.relay.outbox.sources.queue" in checked
