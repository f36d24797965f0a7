"""The relay's own SQL on a real PostgreSQL: the claim's plan, and the mark statement's fence when it
deletes published rows (--delete-on-publish)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from postbox.relay.core.db import connect
from postbox.relay.core.sql import query
from postbox.relay.outbox.daemon import QUERIES
from tests.support.modes import QUEUE_ONLY
from tests.support.servers import Servers

# Queue mode's own statements (the claim of pending rows, the mark that deletes): log mode runs neither on
# the rows it reads.
pytestmark = QUEUE_ONLY

Connection = psycopg.Connection[tuple[Any, ...]]
CLAIM_BYTES = {"max_message_bytes": 1_000_000, "max_batch_bytes": 16 << 20}


def backlog(db: Connection, rows: int, aggregates: int = 500) -> None:
    db.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'o-' || (i %% %s), 'Placed', '{}'::jsonb FROM generate_series(1, %s) AS i",
        (aggregates, rows),
    )


def claim_plan(conn: Connection, shards: list[int]) -> str:
    params = {
        "shards": shards,
        "lock_space": 1,
        "limit": 1000,
        "blocked_topics": [],
        "blocked_types": [],
        **CLAIM_BYTES,
    }
    plan = "\n".join(str(r[0]) for r in conn.execute("EXPLAIN " + query(QUERIES, "claim_batch"), params))
    conn.rollback()
    return plan


@pytest.mark.parametrize("statistics", ["stale after a bulk insert", "taken mid-backlog"])
def test_the_claim_walks_the_pending_index_in_id_order_whatever_the_statistics(
    servers: Servers, schema: str, db: Connection, statistics: str
) -> None:
    # An empty table analyzed, then a large backlog: the planner believes the table is tiny. Or the backlog
    # analyzed while every row is pending, then most of it published: the planner believes all are pending.
    db.execute("ANALYZE outbox")
    backlog(db, 60_000)
    if statistics == "taken mid-backlog":
        db.execute("ANALYZE outbox")
        db.execute("UPDATE outbox SET state = 'published' WHERE id <= 50000")
    pending_indexes = {
        str(r[0])
        for r in db.execute("SELECT relid::regclass::text FROM pg_partition_tree('outbox_pending_idx')")
    }
    with connect(servers.database_url, schema) as lane:
        lane.execute(query(QUERIES, "lane_session"))
        lane.commit()
        for shards in (list(range(64)), list(range(0, 64, 6))):
            plan = claim_plan(lane, shards)
            # The scan that finds and locks the rows (the CTE); above it only the claimed rows are
            # handled (the byte budget's window sorts at most `limit` rows, already in order).
            scan = plan.split("CTE claimed", 1)[1].split("->  WindowAgg", 1)[0]
            # The outbox is partitioned: each partition's share of the pending index, merged in id order.
            outbox_scans = re.findall(r"(\w[\w ]*) on (outbox_\w+) outbox", scan)
            assert outbox_scans, plan
            for how, _partition in outbox_scans:
                assert re.fullmatch(r"Index Scan using (\w+)", how), plan
                assert how.removeprefix("Index Scan using ") in pending_indexes, plan
            assert "Index Cond: (shard = ANY" in scan, plan
            assert not re.search(r"\bSort  \(", scan), plan  # a Sort node, not the Merge Append's key
            assert "Bitmap" not in scan, plan


def test_mark_deletes_published_rows_keeps_the_rest_and_is_fenced_on_the_lease(
    schema: str, db: Connection
) -> None:
    backlog(db, 40, aggregates=5)
    rows = db.execute("SELECT id, shard FROM outbox ORDER BY id").fetchall()
    held_shard = rows[0][1]
    db.execute(
        "UPDATE outbox_shard_lease SET owner = 'me', expires_at = now() + interval '1 minute' "
        "WHERE shard = %s",
        (held_shard,),
    )
    mine = [r[0] for r in rows if r[1] == held_shard]
    others = [r[0] for r in rows if r[1] != held_shard]
    assert len(mine) >= 3, "several rows in the held shard"
    assert others, "rows in other shards too"
    # Mine: published, parked, to retry; one row of another replica's shard, reported published.
    ids = [*mine[:3], others[0]]
    states = ["published", "failed", "pending", "published"]
    errors = [None, "too large", "broker down", None]
    marked = db.execute(
        query(QUERIES, "mark_batch_deleting"),
        {"relay_id": "me", "ids": ids, "states": states, "errors": errors},
    ).fetchall()
    assert sorted(r[0] for r in marked) == sorted(mine[:3])
    left = {
        r[0]: (r[1], r[2], r[3]) for r in db.execute("SELECT id, state, attempts, last_error FROM outbox")
    }
    assert mine[0] not in left, "a published row of a held shard is deleted"
    assert left[mine[1]] == ("failed", 1, "too large")
    assert left[mine[2]] == ("pending", 1, "broker down")
    assert left[others[0]] == ("pending", 0, None), "no lease on its shard: fenced, untouched"
    assert len(left) == 39
