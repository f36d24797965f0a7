"""The relay's delivery guarantees (relay.outbox.delivery and .exactly_once.delivery) without servers: how
each leases and deals shards to lanes, and what an exactly-once batch does with its groups' transactions
when one of them fails. The transactions here are a stand-in that records what is asked of it: what is
tested is the bookkeeping of a batch of several groups (which are committed, aborted, dropped, and what is
learned), not delivery itself, which tests/integration/test_exactly_once.py proves on the real servers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from postbox.relay.outbox.delivery import AtLeastOnce, Published, Rollback
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.exactly_once.delivery import ExactlyOnce, GroupTransaction, TransactionRound
from postbox.relay.outbox.exactly_once.groups import shards_of
from postbox.relay.outbox.exactly_once.settlement import plan
from postbox.relay.outbox.exactly_once.transactions import Ending, Transactions
from postbox.relay.outbox.outcome import DELIVERED, BatchOutcome, Delivery, RowState
from postbox.relay.outbox.shares import SHARD_COUNT
from postbox.relay.outbox.sources.base import RelayConfigurationError
from postbox.relay.outbox.sources.queue import Claimer

REFUSED = Delivery(Disposition.PARK, "Broker: Message size too large")
TIMED_OUT = Delivery(Disposition.RETRY, "Local: Message timed out")


class RecordedTransactions:
    """Stands in for Transactions: every call recorded; commits end as `endings` says, by group."""

    def __init__(self, ready: set[int], endings: dict[int, Ending] | None = None) -> None:
        self.ready = frozenset(ready)
        self.endings = endings or {}
        self.calls: list[tuple[str, int]] = []

    def settlement_delivered(self, transaction: Any) -> Delivery:
        return cast("Delivery", transaction.settlement)

    def commit(self, transaction: Any) -> Ending:
        self.calls.append(("commit", transaction.group))
        return self.endings.get(transaction.group, Ending.COMMITTED)

    def abort(self, transaction: Any) -> Ending:
        self.calls.append(("abort", transaction.group))
        return Ending.ABORTED

    def drop(self, group: int) -> None:
        self.calls.append(("drop", group))

    def renew(self) -> None:
        """The relay's lease renewal, called while the batch waits on the broker."""
        self.calls.append(("renew", -1))


def nothing() -> None:
    pass


def exactly_once(transactions: RecordedTransactions) -> ExactlyOnce:
    return ExactlyOnce(
        cast("Transactions", transactions), Claimer("relay-1", 7, False), lambda identity: identity
    )


def row(row_id: int, shard: int) -> Any:
    return SimpleNamespace(id=row_id, aggregate_id=f"a{row_id}", shard=shard)


def a_round(
    owner: ExactlyOnce, rows: list[Any], settlements: dict[int, Delivery] | None = None
) -> TransactionRound:
    """A batch of `rows` all sent, a transaction per group of their shards (in group order)."""
    planned = plan(
        [r.id for r in rows],
        [r.aggregate_id for r in rows],
        [r.shard for r in rows],
        [None] * len(rows),
        True,
    )
    groups: dict[int, list[int]] = {}
    for index, r in enumerate(rows):
        groups.setdefault(r.shard // 8, []).append(index)
    opened = [
        GroupTransaction(
            g, cast("Any", SimpleNamespace(group=g, settlement=(settlements or {}).get(g, DELIVERED))), sent
        )
        for g, sent in sorted(groups.items())
    ]
    return TransactionRound(owner, planned, opened)


RENEW = nothing
ROWS = [row(1, 0), row(2, 9), row(3, 17), row(4, 1)]  # groups 0, 1, 2, 0


def test_at_least_once_leases_shards_one_by_one_and_reads_every_shard_of_a_lane() -> None:
    delivery = AtLeastOnce(cast("Any", None))
    assert delivery.lease_group == 1
    lanes = delivery.lanes(set(range(SHARD_COUNT)), 2)
    assert sorted(s for lane in lanes for s in lane) == list(range(SHARD_COUNT))
    assert delivery.readable([3, 5]) == [3, 5]
    delivery.check_mode("queue")
    delivery.check_mode("log")
    assert delivery.not_ready(range(SHARD_COUNT)) is None


def test_an_at_least_once_batch_with_nothing_to_send_settles_on_what_was_known() -> None:
    batch = Published(None, [])
    deliveries: list[Delivery | None] = [REFUSED]
    batch.wait(deliveries, lambda: None)
    assert batch.acks() == []
    outcome = batch.settle([row(1, 0)], [REFUSED], RENEW)
    assert isinstance(outcome, BatchOutcome)
    assert outcome.rows[0].state is RowState.FAILED


def test_exactly_once_deals_only_whole_open_groups_and_never_splits_one() -> None:
    transactions = RecordedTransactions(ready={0, 2, 3})
    delivery = exactly_once(transactions)
    owned = set(shards_of(0)) | set(shards_of(2)) | set(shards_of(3)) | {40}  # 40: group 5, in part
    lanes = delivery.lanes(owned, 2)
    assert [sorted({s // 8 for s in lane}) for lane in lanes] == [[0, 3], [2]]
    assert delivery.readable(shards_of(1) + shards_of(2)) == shards_of(2)  # group 1 not open (dropped)
    assert delivery.not_ready(owned) is None
    waiting = delivery.not_ready(owned | set(shards_of(4)))
    assert waiting is not None
    assert "(4;" in waiting
    assert exactly_once(RecordedTransactions(ready=set())).not_ready(set()) is not None


def test_exactly_once_refuses_queue_mode() -> None:
    delivery = exactly_once(RecordedTransactions(ready=set()))
    delivery.check_mode("log")
    with pytest.raises(RelayConfigurationError, match="needs log mode"):
        delivery.check_mode("queue")


def test_a_batch_of_several_groups_commits_each_and_writes_the_planned_outcome() -> None:
    transactions = RecordedTransactions(ready={0, 1, 2})
    outcome = a_round(exactly_once(transactions), ROWS).settle(ROWS, [DELIVERED] * 4, transactions.renew)
    assert isinstance(outcome, BatchOutcome)
    assert outcome.published == 4
    assert transactions.calls == [("commit", 0), ("renew", -1), ("commit", 1), ("renew", -1), ("commit", 2)]


def test_a_commit_that_fails_mid_batch_drops_the_groups_committed_before_and_aborts_the_rest() -> None:
    """The database is rolled back for the whole batch, so group 0's committed settlement must be read
    back (its producer dropped) before it publishes again, and group 2's transaction must not commit. The
    leases are renewed between one wait on the broker and the next."""
    transactions = RecordedTransactions(ready={0, 1, 2}, endings={1: Ending.UNKNOWN})
    settled = a_round(exactly_once(transactions), ROWS).settle(ROWS, [DELIVERED] * 4, transactions.renew)
    assert settled == Rollback(back_off=True)
    assert transactions.calls == [
        ("commit", 0),
        ("renew", -1),
        ("commit", 1),
        ("drop", 0),
        ("renew", -1),
        ("abort", 2),
    ]


def test_a_message_refused_alone_aborts_every_group_and_is_parked_by_the_next_plan() -> None:
    transactions = RecordedTransactions(ready={0, 1, 2})
    owner = exactly_once(transactions)
    settled = a_round(owner, ROWS).settle(
        ROWS, [DELIVERED, REFUSED, DELIVERED, DELIVERED], transactions.renew
    )
    assert settled == Rollback(back_off=False)  # the broker answered: no reason to wait
    assert transactions.calls == [("abort", 0), ("renew", -1), ("abort", 1), ("renew", -1), ("abort", 2)]
    assert owner._learned == {2: REFUSED}
    assert owner._suspects == set()


def test_messages_refused_together_are_suspects_each_tried_alone() -> None:
    owner = exactly_once(RecordedTransactions(ready={0, 1, 2}))
    settled = a_round(owner, ROWS).settle(ROWS, [REFUSED, REFUSED, DELIVERED, DELIVERED], RENEW)
    assert settled == Rollback(back_off=False)
    assert owner._suspects == {1, 2}


def test_a_message_or_a_settlement_not_delivered_aborts_every_group_and_backs_off() -> None:
    transactions = RecordedTransactions(ready={0, 1, 2})
    settled = a_round(exactly_once(transactions), ROWS).settle(
        ROWS, [DELIVERED, DELIVERED, TIMED_OUT, DELIVERED], RENEW
    )
    assert settled == Rollback(back_off=True)
    assert [c for c, _ in transactions.calls] == ["abort"] * 3
    transactions = RecordedTransactions(ready={0, 1, 2})
    settled = a_round(exactly_once(transactions), ROWS, {1: TIMED_OUT}).settle(ROWS, [DELIVERED] * 4, RENEW)
    assert settled == Rollback(back_off=True)
    assert [c for c, _ in transactions.calls] == ["abort"] * 3


def test_a_settled_batch_forgets_what_its_rows_taught() -> None:
    owner = exactly_once(RecordedTransactions(ready={0, 1, 2}))
    owner.learn(ROWS, 1, [(0, REFUSED)])
    assert owner._learned == {1: REFUSED}
    a_round(owner, ROWS).settle(ROWS, [DELIVERED] * 4, RENEW)
    assert owner._learned == {}


def test_a_batch_whose_mark_was_fenced_drops_every_group_it_committed() -> None:
    transactions = RecordedTransactions(ready={0, 1, 2})
    a_round(exactly_once(transactions), ROWS).mark_fenced()
    assert transactions.calls == [("drop", 0), ("drop", 1), ("drop", 2)]
