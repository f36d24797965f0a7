"""A downstream service for the inbox tests: deposits change a balance, and every applied effect is logged
(with no unique key, so a double application would show as two rows)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from postbox.inbox import Inbox, Message, PermanentError

inbox = Inbox(
    "bank", max_attempts=3, retry_backoff=0.01, dead_letter_topic=os.environ.get("BANK_DLQ") or None
)
APP = "tests.apps.bank:inbox"  # this inbox, as `--app` names it

SCHEMA_SQL = """
CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
CREATE TABLE effects (message_id text NOT NULL, account text NOT NULL, amount bigint NOT NULL);
"""


@inbox.handler("Deposit")
def deposit(tx: Any, message: Message) -> None:
    body = message.payload
    tx.execute(
        "INSERT INTO accounts (id, balance) VALUES (%s, %s) "
        "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        (body["account"], body["amount"]),
    )
    tx.execute(
        "INSERT INTO effects VALUES (%s, %s, %s)", (message.message_id, body["account"], body["amount"])
    )


@inbox.handler("Poison")
def poison(tx: Any, message: Message) -> None:
    tx.execute("INSERT INTO effects VALUES (%s, 'poison', 0)", (message.message_id,))  # rolled back each time
    raise RuntimeError("this event can never be applied")


@inbox.handler("Refused")
def refused(tx: Any, message: Message) -> None:
    raise PermanentError("account closed")


@inbox.after_commit
def crash_once_after_commit(messages: list[Message]) -> None:
    """With BANK_CRASH_FLAG set: SIGKILL ourselves after the first commit, before the offset commit."""
    flag = os.environ.get("BANK_CRASH_FLAG")
    if flag and messages and not Path(flag).exists():
        Path(flag).write_text(",".join(m.message_id for m in messages))
        os.kill(os.getpid(), signal.SIGKILL)


@inbox.after_commit
def log_applied(messages: list[Message]) -> None:
    """With BANK_HOOK_LOG set: each message the hooks were called for, a line each (the test reads it)."""
    path = os.environ.get("BANK_HOOK_LOG")
    if path:
        with Path(path).open("a") as out:
            out.writelines(f"{m.message_id}\n" for m in messages)
