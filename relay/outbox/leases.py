"""Shard leases: which replica drains which shard, renewed on the database clock, rebalanced as replicas
come and go. Runs on its own autocommit connection so it can renew while a batch waits for Kafka."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import psycopg
import structlog

from postbox.relay.core.sql import query
from postbox.relay.outbox.shares import SHARD_COUNT, fair_share

QUERIES = Path(__file__).with_name("queries.sql")
log = structlog.get_logger("postbox.relay.leases")


class LeaseKeeper:
    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        relay_id: str,
        ttl: float,
        group_shards: int = 1,
    ) -> None:
        """group_shards: leases are taken and given in whole groups of this many shards (exactly-once);
        shards of a group held only in part are given back."""
        assert conn.autocommit, "leases change on their own, outside any batch transaction"
        assert SHARD_COUNT % group_shards == 0
        self._group_shards = group_shards
        self._conn = conn
        self._relay_id = relay_id
        self._ttl = timedelta(seconds=ttl)
        self._renew_every = ttl / 3
        self._next_tick = 0.0
        self.owned: frozenset[int] = frozenset()
        self.lost: frozenset[int] = (
            frozenset()
        )  # shards whose lease expired while held, found by the last tick

    def _params(self, **extra: object) -> dict[str, object]:
        return {"relay_id": self._relay_id, "ttl": self._ttl, **extra}

    def due(self) -> bool:
        return time.monotonic() >= self._next_tick

    def recheck_now(self) -> None:
        """A mark was fenced: some lease is gone. Make the next tick due at once, so the relay stops
        claiming the shards it lost after this batch instead of claiming, publishing and being fenced
        again until the regular renewal (each round a batch of duplicates)."""
        self._next_tick = 0.0

    def tick(self) -> frozenset[int]:
        """Heartbeat, renew what we hold, then take or give shards toward our fair share."""
        self._next_tick = time.monotonic() + self._renew_every
        conn = self._conn
        conn.execute(query(QUERIES, "heartbeat"), self._params())
        renewed = {int(str(r[0])) for r in conn.execute(query(QUERIES, "renew_leases"), self._params())}
        lost = self.owned - renewed
        self.lost = frozenset(lost)
        if lost:
            log.warning("relay_leases_lost", shards=sorted(lost))
        for relay_id, sessions in conn.execute(query(QUERIES, "fence_expired_members"), self._params()):
            log.warning(
                "relay_expired_member_fenced", member=str(relay_id), sessions_ended=int(str(sessions))
            )
        members = [str(r[0]) for r in conn.execute(query(QUERIES, "live_members"), self._params())]
        size = self._group_shards
        target = fair_share(self._relay_id, members, SHARD_COUNT // size) * size
        held = set(renewed)
        if size > 1:
            partial = [s for s in held if not held.issuperset(range(s - s % size, s - s % size + size))]
            if partial:
                conn.execute(query(QUERIES, "release_leases"), self._params(shards=partial))
                log.info("relay_partial_groups_released", shards=sorted(partial))
                held -= set(partial)
        if len(held) < target:
            if size > 1:
                wanted = (target - len(held)) // size
                rows = conn.execute(
                    query(QUERIES, "acquire_lease_groups"), self._params(wanted=wanted, group_shards=size)
                )
            else:
                rows = conn.execute(query(QUERIES, "acquire_leases"), self._params(wanted=target - len(held)))
            taken = {int(str(r[0])) for r in rows}
            if taken:
                log.info("relay_shards_acquired", count=len(taken), owned=len(held) + len(taken))
            held |= taken
        elif len(held) > target:
            rows = conn.execute(query(QUERIES, "release_some_leases"), self._params(count=len(held) - target))
            given = {int(str(r[0])) for r in rows}
            log.info("relay_shards_released", count=len(given), owned=len(held) - len(given))
            held -= given
        self.owned = frozenset(held)
        return self.owned

    def renew_only(self) -> None:
        """Keep the leases alive while a batch is in flight (no rebalancing mid-batch)."""
        if not self.due():
            return
        self._next_tick = time.monotonic() + self._renew_every
        self._conn.execute(query(QUERIES, "heartbeat"), self._params())
        self._conn.execute(query(QUERIES, "renew_leases"), self._params())

    def release_all(self) -> None:
        self._conn.execute(query(QUERIES, "release_all_leases"), self._params())
        self._conn.execute(query(QUERIES, "leave"), self._params())
        self.owned = frozenset()
