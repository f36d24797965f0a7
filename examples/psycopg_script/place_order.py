"""Places an order and writes its OrderChanged event in one transaction, with psycopg 3:

    python examples/psycopg_script/place_order.py 9.99

DATABASE_URL names the database (a libpq URL or conninfo), POSTBOX_SCHEMA the outbox's schema (default
postbox). The `orders` table is created when missing.
"""

from __future__ import annotations

import argparse
import os
import uuid
from decimal import Decimal

import psycopg
from psycopg.rows import TupleRow

from postbox import enqueue

ORDERS_TABLE = """
CREATE TABLE IF NOT EXISTS orders (
    id      text PRIMARY KEY,
    total   numeric(12, 2) NOT NULL CONSTRAINT orders_total_check CHECK (total >= 0),
    version integer NOT NULL DEFAULT 1
)"""


def place_order(conn: psycopg.Connection[TupleRow], total: Decimal, schema: str) -> tuple[str, uuid.UUID]:
    """The order and its event, committed together (or, on any error, neither)."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (id, total) VALUES (%s, %s) RETURNING id, total, version",
            (str(uuid.uuid4()), total),
        ).fetchone()
        assert row is not None
        order_id, stored_total, version = row
        event_id = enqueue(
            conn,
            "order",
            order_id,
            "OrderChanged",
            {"order": order_id, "total": str(stored_total), "seq": version},
            schema=schema,
        )
    return str(order_id), event_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("total", type=Decimal, help="the order's total, e.g. 9.99")
    args = parser.parse_args()
    # autocommit: each `conn.transaction()` block is one transaction of its own (BEGIN ... COMMIT)
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(ORDERS_TABLE)
        order_id, event_id = place_order(conn, args.total, os.environ.get("POSTBOX_SCHEMA", "postbox"))
    print(f"order {order_id} placed, event {event_id}")


if __name__ == "__main__":
    main()
