"""The bank service of tests.apps.bank, a release later: it now handles `Nope` events too (which the first
release parked as unhandled), so `postbox inbox requeue` can apply them."""

from __future__ import annotations

from typing import Any

from postbox.inbox import Inbox, Message
from tests.apps.bank import deposit, log_applied

inbox = Inbox("bank", max_attempts=3, retry_backoff=0.01)
inbox.handler("Deposit")(deposit)
inbox.after_commit(log_applied)


@inbox.handler("Nope")
def nope(tx: Any, message: Message) -> None:
    tx.execute("INSERT INTO effects VALUES (%s, 'nope', 0)", (message.message_id,))
