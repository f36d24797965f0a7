"""Messages for tests.apps.bank and what it did with them: deposits (Deposit messages to produce) and
effects (how many times each message was applied)."""

from __future__ import annotations

import uuid

import psycopg

Conn = psycopg.Connection[tuple[object, ...]]


def deposits(n: int, accounts: int = 5, amount: int = 10) -> list[tuple[str, str, dict[str, object]]]:
    return [
        (f"dep-{uuid.uuid4().hex}", "Deposit", {"account": f"acct-{i % accounts}", "amount": amount})
        for i in range(n)
    ]


def effects(db: Conn) -> dict[str, int]:
    return {
        str(m): int(str(c))
        for m, c in db.execute("SELECT message_id, count(*) FROM effects GROUP BY message_id").fetchall()
    }
