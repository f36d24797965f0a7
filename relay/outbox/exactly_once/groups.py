"""The fixed groups of shards exactly-once publication binds its transactional producers to. Pure.

A group's shards are leased together (a relay takes and gives whole groups), read by one lane, and
published through one producer whose transactional.id names the group: the next owner's
init_transactions fences the previous one's producer, whatever state it was left in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from postbox.relay.outbox.shares import SHARD_COUNT

GROUP_SHARDS = 8  # shards per group: 8 groups, so up to 8 replicas share the work
GROUP_COUNT = SHARD_COUNT // GROUP_SHARDS


def group_of(shard: int) -> int:
    return shard // GROUP_SHARDS


def shards_of(group: int) -> list[int]:
    return list(range(group * GROUP_SHARDS, (group + 1) * GROUP_SHARDS))


def whole_groups(shards: Iterable[int]) -> list[int]:
    """The groups all of whose shards are in `shards`, in order."""
    owned = set(shards)
    return [g for g in range(GROUP_COUNT) if owned.issuperset(shards_of(g))]


def partial_shards(shards: Iterable[int]) -> list[int]:
    """The shards of `shards` whose group is not wholly in it: a relay in exactly-once mode gives them
    back, so that the group can be taken whole."""
    owned = set(shards)
    whole = set(whole_groups(owned))
    return sorted(s for s in owned if group_of(s) not in whole)


def split_groups(groups: Sequence[int], lanes: int) -> list[list[int]]:
    """Whole groups dealt into at most `lanes` lanes, as shard lists (a group is never split)."""
    ordered = sorted(groups)
    dealt = (ordered[i::lanes] for i in range(lanes))
    return [[s for g in lane for s in shards_of(g)] for lane in dealt if lane]


def groups_in(shards: Iterable[int]) -> list[int]:
    return sorted({group_of(s) for s in shards})
