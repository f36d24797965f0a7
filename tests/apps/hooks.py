"""A webhook-consuming service for the tests: every applied event leaves one row in `applied` (no unique
key, so a double application would show as two)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psycopg

from postbox.inbox.webhooks.providers import IncomingEvent
from postbox.inbox.webhooks.worker import WebhookEvent, Webhooks

hooks = Webhooks(max_attempts=3, visibility_timeout=2.0, retry_backoff=0.05)

SCHEMA_SQL = "CREATE TABLE applied (provider text NOT NULL, event_id text NOT NULL, event_type text NOT NULL)"


def _apply(tx: Any, event: WebhookEvent) -> None:
    tx.execute("INSERT INTO applied VALUES (%s, %s, %s)", (event.provider, event.event_id, event.event_type))


@hooks.handler("stripe", "invoice.paid")
def invoice_paid(tx: Any, event: WebhookEvent) -> None:
    _apply(tx, event)
    flag = os.environ.get("HOOKS_CRASH_FLAG")
    if flag and not Path(flag).exists():  # die mid-event, after the handler's write, before the commit
        Path(flag).write_text(event.event_id)
        os.kill(os.getpid(), signal.SIGKILL)


@hooks.handler("stripe", "poison.event")
def poison(tx: Any, event: WebhookEvent) -> None:
    _apply(tx, event)  # rolled back with each failure
    raise RuntimeError("cannot be applied")


@hooks.handler("stripe", "invoice.async_paid")
async def async_invoice_paid(tx: psycopg.AsyncConnection[Any], event: WebhookEvent) -> None:
    """An async handler: awaited with an AsyncConnection in the transaction that marks the event done."""
    await tx.execute(
        "INSERT INTO applied VALUES (%s, %s, %s)", (event.provider, event.event_id, event.event_type)
    )


@hooks.handler("stripe", "async.poison")
async def async_poison(tx: psycopg.AsyncConnection[Any], event: WebhookEvent) -> None:
    await tx.execute("INSERT INTO applied VALUES (%s, %s, 'rolled back')", (event.provider, event.event_id))
    raise RuntimeError("cannot be applied, asynchronously")


for _provider in ("stripe", "shopify", "marqeta"):
    hooks.handler(_provider, "*")(_apply)


class TickingReconciler:
    """A provider API that reports one new event per pass (`postbox inbox reconcile --every`)."""

    provider = "stripe"

    def __init__(self) -> None:
        self.passes = 0

    def recent_events(self, since: Any) -> list[IncomingEvent]:
        self.passes += 1
        return [IncomingEvent("stripe", f"evt_pass_{os.getpid()}_{self.passes}", "invoice.paid", {})]
