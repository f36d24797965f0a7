"""Reconciliation: re-fetch recent events from the provider's API and feed them through the same
deduplicating insert, so an event whose webhook never arrived is still processed (Shopify recommends it;
Stripe's own advice for out-of-order events is to re-fetch)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol, cast

import psycopg

from postbox.inbox.webhooks.providers import IncomingEvent, stripe_event
from postbox.inbox.webhooks.store import store_events


class Reconciler(Protocol):
    provider: str

    def recent_events(self, since: datetime) -> Iterable[IncomingEvent]:
        """Events the provider created at or after `since`, shaped as the webhook would deliver them."""
        ...


class StripeReconciler:
    """Lists Stripe events with the official `stripe` library (pip install 'postbox[stripe]')."""

    provider = "stripe"

    def __init__(
        self, api_key: str, base_url: str = "https://api.stripe.com", types: list[str] | None = None
    ) -> None:
        import stripe  # noqa: PLC0415  (optional dependency)

        self._client = stripe.StripeClient(api_key, base_addresses={"api": base_url})
        self._types = types

    def recent_events(self, since: datetime) -> Iterable[IncomingEvent]:
        params: dict[str, Any] = {"created": {"gte": int(since.timestamp())}, "limit": 100}
        if self._types:
            params["types"] = self._types
        listing = self._client.v1.events.list(params=cast("Any", params))  # EventListParams is a TypedDict
        for event in listing.auto_paging_iter():
            yield stripe_event(event.to_dict(), self.provider)


def reconcile(
    conn: psycopg.Connection[Any], reconciler: Reconciler, since: datetime, batch_size: int = 100
) -> tuple[int, int]:
    """Insert what the provider reports since `since`; returns (events seen, events that were new)."""
    seen = new = 0
    batch: list[IncomingEvent] = []

    def flush() -> None:
        nonlocal new
        with conn.transaction():
            new += store_events(conn, batch)
        batch.clear()

    for event in reconciler.recent_events(since):
        seen += 1
        batch.append(event)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    return seen, new
