"""A settlement read back from Kafka, written into PostgreSQL where it is missing: the one write of
exactly-once publication outside a batch (transactions.py hands it over when a group is opened)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import structlog

from postbox.relay.core.sql import query
from postbox.relay.outbox.exactly_once.groups import shards_of
from postbox.relay.outbox.exactly_once.settlement import Settlement
from postbox.relay.outbox.outcome import RowState
from postbox.relay.outbox.sources.base import Connection
from postbox.relay.outbox.sources.log_reader import advance_from
from postbox.relay.outbox.sources.queue import Claimer

QUERIES = Path(__file__).parent.parent / "queries.sql"  # relay/outbox/queries.sql
log = structlog.get_logger("postbox.relay.exactly_once")


class ForeignSettlement(RuntimeError):
    """The cursor topic holds another outbox's settlement: two outboxes share a transactional-id prefix."""


def outbox_identity(conn: Connection) -> str:
    """The outbox's id and its copy's (see Settlement.outbox): "<outbox id>/<cursor table oid>"."""
    found = conn.execute(query(QUERIES, "outbox_identity")).fetchone()
    assert found is not None
    return str(found[0])


def write_back(conn: Connection, claimer: Claimer, settlement: Settlement) -> bool:
    """Write what the database lacks of `settlement`, in one transaction on `conn` (autocommit), while this
    relay leases every shard of its group: each cursor still where the batch found it moves where the
    batch left it, with the rows the batch parked in those shards; each row the batch published from the
    queue (pending rows, claimed one by one) and still pending is marked published. (A claimed row it
    parked was not sent: left pending, it is claimed and parked again, or published if requeued since.)

    False when the leases are no longer all this relay's, or another session holds the rows past a short
    wait: the group is not opened, and tried again at the next tick. ForeignSettlement when the settlement
    is another outbox's."""
    identity = outbox_identity(conn)
    if settlement.outbox != identity:
        if settlement.outbox.partition("/")[0] != identity.partition("/")[0]:
            raise ForeignSettlement(
                f"the cursor topic's settlement of group {settlement.group} is another outbox's "
                f"({settlement.outbox}, this one is {identity}): each outbox on a Kafka cluster needs a "
                "--transactional-id-prefix of its own"
            )
        # This outbox's id in another copy of it (restored from a dump): its cursors are not this copy's.
        log.info("relay_settlement_of_another_copy", group=settlement.group, outbox=settlement.outbox)
        return True
    cursors = [m for m in settlement.moves if m.before != m.after]
    published = [o for o in settlement.marked if o.state is RowState.PUBLISHED]
    shards = shards_of(settlement.group)
    try:
        with conn.transaction():
            conn.execute(query(QUERIES, "settle_lock_timeout"))
            held = conn.execute(
                query(QUERIES, "settle_leases_held"), {"shards": shards, "relay_id": claimer.relay_id}
            ).fetchone()
            if held is None or int(str(held[0])) != len(shards):
                return False
            moved = advance_from(conn, claimer.relay_id, cursors) if cursors else []
            parked = 0
            if settlement.parked and moved:
                parked = conn.execute(
                    query(QUERIES, "settle_park"),
                    {
                        "relay_id": claimer.relay_id,
                        "shards": moved,
                        "ids": [o.row_id for o in settlement.parked],
                        "errors": [o.error for o in settlement.parked],
                        "held_for": [o.held_for for o in settlement.parked],
                    },
                ).rowcount
            marked = claimer.mark_rows(conn, published) if published else 0
    except psycopg.errors.LockNotAvailable:
        return False
    if moved or parked or marked:
        # The batch's Kafka transaction committed and the database's did not: written now, so none of its
        # rows is published again.
        log.warning(
            "relay_settlement_written_back",
            group=settlement.group,
            by=settlement.relay_id,
            cursors=sorted(moved),
            parked=parked,
            marked=marked,
        )
    return True
