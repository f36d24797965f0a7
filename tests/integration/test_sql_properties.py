"""Property tests (hypothesis) of the relay's and the inbox's SQL paths on the real PostgreSQL.

Whatever a writer with INSERT puts in an outbox row, the relay's claim, routing and mark statements run
without error and leave the row published, parked or pending for a reason; whatever bytes a Kafka record
carries as its id, the inbox's claim statement stores it, or the id is refused before the statement and
the record is claimed under its coordinates instead. These are the statements the daemons run, with the
parameters they build, so an error here would be a daemon stopped by one input.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postbox.inbox.message import IdSource, MessageIdMissing, coordinates
from postbox.relay.core.sql import query
from postbox.relay.outbox.daemon import QUERIES as RELAY_QUERIES
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import DELIVERED, Delivery, decide
from postbox.relay.outbox.routing import OutboxRow, RoutingError, to_message, topic_for
from postbox.relay.outbox.settings import DEFAULT_MESSAGE_MAX_BYTES
from tests.support.modes import BOTH_MODES, QUEUE_ONLY

Conn = psycopg.Connection[tuple[Any, ...]]
INBOX_QUERIES = RELAY_QUERIES.parents[2] / "inbox" / "queries.sql"
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Text PostgreSQL can store (no NUL, no lone surrogate), including formatter and Kafka metacharacters.
stored_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=300
) | st.sampled_from(["", ".", "..", "__consumer_offsets", "{aggregate_type}", "a/b", "x" * 260, "ok.topic"])
json_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | stored_text
json_value = st.recursive(
    json_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(stored_text, inner, max_size=3)
)
row_values = st.fixed_dictionaries(
    {
        "aggregate_type": stored_text,
        "aggregate_id": stored_text,
        "event_type": stored_text,
        "payload": json_value,
        "headers": st.dictionaries(stored_text, json_value, max_size=4),
        "topic": st.none() | stored_text,
        "attempts": st.integers(-(2**31), 2**31 - 1),
    }
)


@QUEUE_ONLY  # queue mode's claim and mark statements, run on rows written in queue mode's state
@SETTINGS
@given(rows=st.lists(row_values, min_size=1, max_size=5))
def test_any_row_a_writer_inserts_goes_through_claim_routing_and_mark(
    db: Conn, rows: list[dict[str, Any]]
) -> None:
    db.execute("DELETE FROM outbox")
    db.execute("UPDATE outbox_shard_lease SET owner = 'prop', expires_at = now() + interval '1 hour'")
    for values in rows:
        db.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, topic, "
            "attempts) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (
                values["aggregate_type"],
                values["aggregate_id"],
                values["event_type"],
                json.dumps(values["payload"]),
                json.dumps(values["headers"]),
                values["topic"],
                values["attempts"],
            ),
        )
    with db.transaction():
        claimed = db.execute(
            query(RELAY_QUERIES, "claim_batch"),
            {
                "shards": list(range(64)),
                "lock_space": 1,
                "limit": 1000,
                "blocked_topics": [],
                "blocked_types": [],
                "max_message_bytes": DEFAULT_MESSAGE_MAX_BYTES,
                "max_batch_bytes": 16 << 20,
            },
        ).fetchall()
        batch = [OutboxRow(*r[:-1]) for r in claimed]
        assert len(batch) == len(rows)
        deliveries: list[Delivery] = []
        for row in batch:
            try:
                to_message(row, topic_for(row, "outbox.event.{aggregate_type}"), "eventType")
                deliveries.append(DELIVERED)
            except RoutingError as exc:
                deliveries.append(Delivery(Disposition.PARK, str(exc)))
        outcome = decide([r.id for r in batch], [r.aggregate_id for r in batch], deliveries)
        marked = db.execute(
            query(RELAY_QUERIES, "mark_batch"),
            {
                "relay_id": "prop",
                "ids": [o.row_id for o in outcome.rows],
                "states": [o.state for o in outcome.rows],
                "errors": [o.error for o in outcome.rows],
            },
        ).rowcount
    assert marked == len(rows)
    states = dict(db.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall())
    assert sum(states.values()) == len(rows)
    assert set(states) <= {"published", "failed"}, "routing decides every row: published or parked"


@SETTINGS
@given(raw_ids=st.lists(st.binary(max_size=1500) | stored_text.map(str.encode), min_size=1, max_size=8))
def test_any_id_bytes_are_claimed_as_given_or_under_their_coordinates(db: Conn, raw_ids: list[bytes]) -> None:
    db.execute("DELETE FROM inbox_message")
    source = IdSource.parse("header:id")
    ids = []
    for offset, raw in enumerate(raw_ids):
        try:
            ids.append(source.extract("t", 0, offset, {"id": raw}, None))
        except MessageIdMissing:
            ids.append(coordinates("t", 0, offset))
    claimed = db.execute(
        query(INBOX_QUERIES, "claim_messages"),
        {
            "consumer": "prop",
            "ids": ids,
            "topics": ["t"] * len(ids),
            "partitions": [0] * len(ids),
            "offsets": list(range(len(ids))),
            "keys": [None] * len(ids),
        },
    ).fetchall()
    assert {str(r[0]) for r in claimed} == set(ids), "every distinct id stored as it was extracted"


def test_a_record_the_database_refuses_is_parked_alone_and_its_batch_claimed(
    servers: Any, schema: str
) -> None:
    """The claim's fallback: ids are checked before the statement, but should the database (or psycopg)
    still refuse one record (here an id with NUL, bypassing the check), the batch is claimed one record at
    a time and only the refused record is parked, under its coordinates."""
    from postbox.inbox.applying import Applier, Work  # noqa: PLC0415
    from postbox.inbox.calling import HandlerCaller  # noqa: PLC0415
    from postbox.inbox.handlers import Inbox  # noqa: PLC0415
    from postbox.inbox.message import Message  # noqa: PLC0415
    from postbox.inbox.metrics import InboxMetrics  # noqa: PLC0415
    from postbox.relay.core.db import connect  # noqa: PLC0415

    applier = Applier(Inbox("fallback", schema=schema), InboxMetrics(), HandlerCaller())
    work = [
        Work(Message("t", 0, offset, None, b"{}", {}, message_id, None))
        for offset, message_id in enumerate(["ok-1", "bad\x00id", "ok-2"])
    ]
    with connect(servers.database_url, schema) as conn, conn.transaction():
        claimed = applier._claim(conn, work)
    assert claimed == {"ok-1", "t/0/1", "ok-2"}
    assert work[1].missing_id is not None
    assert "refused by the database" in work[1].missing_id
    assert work[1].message.message_id == "t/0/1"


# Every column a writer's role can set on INSERT (the table owner: no column grant restricts it), each
# left to its default or given a value, the relay's own columns and the ones it reads rows by included.
writer_columns = st.fixed_dictionaries(
    {},
    optional={
        "event_id": st.uuids().map(str),
        "state": st.sampled_from(["pending", "published", "failed", "logged", "other"]),
        "txid": st.sampled_from(["0", "3", "current", "current - 5", "current + 5", "current + 50000000"]),
        "created_at": st.sampled_from(["infinity", "-infinity", "2000-01-01", "now"]),
        "published_at": st.sampled_from(["infinity", "2000-01-01", "now"]),
        "attempts": st.integers(-(2**31), 2**31 - 1),
        "last_error": stored_text,
        "topic": st.none() | stored_text,
    },
)


@BOTH_MODES
@SETTINGS
@given(columns=writer_columns)
def test_whatever_columns_a_writer_sets_a_committed_row_is_one_a_relay_reads(
    db: Conn, relay_mode: str, columns: dict[str, Any]
) -> None:
    """An INSERT is refused (naming what it cannot honour) or its row is committed in the state the
    outbox's relays read, with its own transaction's txid, or as a parked row: never stranded."""
    names, values, params = ["aggregate_type", "aggregate_id", "event_type"], ["'t'", "'a'", "'E'"], []
    for name, value in columns.items():
        names.append(name)
        if name == "txid":
            relative = value.replace("current", "pg_current_xact_id()::text::bigint")
            values.append(f"({relative})::text::xid8" if "current" in value else "%s")
            if "current" not in value:
                params.append(value)
        else:
            values.append("%s")
            params.append(value)
    statement = f"INSERT INTO outbox ({', '.join(names)}) VALUES ({', '.join(values)}) RETURNING id"
    refused: psycopg.Error | None = None
    try:
        with db.transaction():
            found = db.execute(statement, params).fetchone()
            assert found is not None
            row_id = found[0]
            own = db.execute(
                "SELECT state, CASE WHEN txid = pg_current_xact_id() THEN 'own' ELSE txid::text END "
                "FROM outbox WHERE id = %s",
                (row_id,),
            ).fetchone()
    except psycopg.Error as exc:
        refused = exc
    if refused is not None:
        # The guard names the column it cannot honour; a CHECK constraint refuses a state no mode has.
        assert refused.sqlstate in {"428C9", "23514"}, f"{refused.sqlstate}: {refused}"
        if refused.sqlstate == "428C9":
            assert refused.diag.column_name in {"txid", "state"} & set(columns)
        return
    # Read by the relays of the outbox's mode; or parked, among the parked rows (txid 0, where maintenance
    # moves them), which `postbox relay status` lists and requeue puts back.
    assert own in {("logged" if relay_mode == "log" else "pending", "own"), ("failed", "0")}
    stranded = db.execute("SELECT count(*) FROM outbox_stranded WHERE id = %s", (row_id,)).fetchone()
    assert stranded == (0,)
