"""The bank of tests.apps.bank written the other ways a service writes handlers: `async def` handlers on the
AsyncConnection postbox gives them, a `def` one beside them in the same Inbox, and handlers that ask for
their payload typed (a pydantic model, a dataclass). Same tables: a double application shows as two rows
in `effects`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from postbox import Inbox, Message

inbox = Inbox("async-bank", max_attempts=3, retry_backoff=0.01)

CREDIT = (
    "INSERT INTO accounts (id, balance) VALUES (%s, %s) "
    "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance"
)


class Deposit(BaseModel):
    account: str
    amount: int


@dataclass(frozen=True)
class DepositRecord:
    account: str
    amount: int


async def credit(tx: psycopg.AsyncConnection[Any], message_id: str, account: str, amount: int) -> None:
    await tx.execute(CREDIT, (account, amount))
    async with tx.cursor() as cursor:  # a cursor of its own, as handlers often use
        await cursor.execute("INSERT INTO effects VALUES (%s, %s, %s)", (message_id, account, amount))


@inbox.handler("AsyncDeposit")
async def async_deposit(tx: psycopg.AsyncConnection[Any], message: Message) -> None:
    body = message.payload
    await credit(tx, message.message_id, body["account"], body["amount"])


@inbox.handler("SyncDeposit")
def sync_deposit(tx: psycopg.Connection[Any], message: Message) -> None:
    body = message.payload
    tx.execute(CREDIT, (body["account"], body["amount"]))
    tx.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (message.message_id, body["account"], body["amount"])
    )


@inbox.handler("TypedDeposit", payload_type=Deposit)
async def typed_deposit(tx: psycopg.AsyncConnection[Any], message: Message) -> None:
    deposit: Deposit = message.payload
    assert isinstance(deposit, Deposit), type(deposit)
    await credit(tx, message.message_id, deposit.account, deposit.amount)


@inbox.handler("RecordDeposit", payload_type=DepositRecord)
def record_deposit(tx: psycopg.Connection[Any], message: Message) -> None:
    deposit: DepositRecord = message.payload
    assert isinstance(deposit, DepositRecord), type(deposit)
    tx.execute(CREDIT, (deposit.account, deposit.amount))
    tx.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (message.message_id, deposit.account, deposit.amount)
    )


@inbox.handler("AsyncPoison")
async def async_poison(tx: psycopg.AsyncConnection[Any], message: Message) -> None:
    await tx.execute("INSERT INTO effects VALUES (%s, 'poison', 0)", (message.message_id,))  # rolled back
    raise RuntimeError("this event can never be applied")


@inbox.handler("AsyncLater")
async def async_later(tx: psycopg.AsyncConnection[Any], message: Message) -> None:
    """Fails until the file ASYNC_BANK_READY names exists (the test's "fixed release"), then applies."""
    ready = os.environ.get("ASYNC_BANK_READY")
    if not ready or not Path(ready).exists():
        raise RuntimeError("not yet")
    await credit(tx, message.message_id, "later", 1)


@inbox.after_commit
async def log_applied(messages: list[Message]) -> None:
    """With BANK_HOOK_LOG set: each message the (async) hook was called for, a line each."""
    path = os.environ.get("BANK_HOOK_LOG")
    if path:
        with Path(path).open("a") as out:
            out.writelines(f"{m.message_id}\n" for m in messages)
