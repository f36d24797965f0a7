"""How many shards each live relay replica should own. Pure."""

from __future__ import annotations

from collections.abc import Sequence

SHARD_COUNT = 64  # fixed by the schema (outbox_shard_of)


def fair_share(me: str, live_members: Sequence[str], total: int = SHARD_COUNT) -> int:
    """Shards `me` should hold: the shards split as evenly as possible, the remainder to the lowest ids.

    Every replica computes the same split from the same member list, so their shares add up to `total`.
    """
    members = sorted(set(live_members) | {me})
    base, remainder = divmod(total, len(members))
    return base + (1 if members.index(me) < remainder else 0)


def split_lanes(shards: Sequence[int], lanes: int) -> list[list[int]]:
    """Owned shards dealt into at most `lanes` disjoint, non-empty groups (every shard in exactly one).

    Each lane's batches run one after another on their own connection, so a shard is never in two open
    batches: that is what keeps per-aggregate order while batches overlap.
    """
    ordered = sorted(shards)
    return [group for group in (ordered[i::lanes] for i in range(lanes)) if group]
