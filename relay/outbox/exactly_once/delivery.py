"""Exactly-once delivery (--exactly-once): the relay's DeliveryGuarantee (delivery.py) that publishes a
batch as one Kafka transaction per group of shards, each carrying its group's settlement, committed before
the database is written.

- Leases and lanes: whole groups only, a group in one lane (its producer has one transaction at a time).
- A lease tick opens the groups now owned (init_transactions fences older owners; the last settlement is
  read back and written where the database lacks it) and closes those given up.
- A batch reads the page of its lane's open groups, plans it (which rows are sent, parked, held back),
  and begins a transaction for each group that sends rows. Every transaction commits, then the database
  is written; when any does not, the others are aborted (or, committed already, their groups read back)
  and the database rolled back.
- What an aborted transaction teaches (a row the broker refuses for good) is kept by row id for the next
  attempt's plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog
from confluent_kafka import KafkaException

from postbox.relay.outbox.delivery import ROW_AGGREGATE_ID, ROW_ID, LeaseTurn, Rollback
from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.exactly_once.groups import (
    GROUP_SHARDS,
    group_of,
    groups_in,
    shards_of,
    split_groups,
    whole_groups,
)
from postbox.relay.outbox.exactly_once.settlement import Plan, Settlement, plan
from postbox.relay.outbox.exactly_once.transactions import (
    Ending,
    GroupNotReady,
    OpenTransaction,
    Transactions,
)
from postbox.relay.outbox.exactly_once.write_back import ForeignSettlement, outbox_identity, write_back
from postbox.relay.outbox.outcome import BatchOutcome, Delivery, RowState
from postbox.relay.outbox.sources.base import Connection, RelayConfigurationError
from postbox.relay.outbox.sources.queue import Claimer

if TYPE_CHECKING:
    from postbox.relay.outbox.batch import Prepared
    from postbox.relay.outbox.publisher import Ack
    from postbox.relay.outbox.routing import OutboxRow
    from postbox.relay.outbox.sources.base import Page

log = structlog.get_logger("postbox.relay")
LEARNED_LIMIT = 100_000  # fates kept by row id at most: past it they are forgotten (learned again if need be)


class ExactlyOnce:
    lease_group = GROUP_SHARDS

    def __init__(
        self, transactions: Transactions, claimer: Claimer, transactional_prefix: Callable[[str], str]
    ):
        """transactions: the groups' transactional producers. claimer: writes back the rows a settlement
        marks. transactional_prefix: the outbox's transactional-id prefix, from its identity."""
        self.transactions = transactions
        self._claimer = claimer
        self._prefix = transactional_prefix
        self.outbox_identity = ""  # read at each connect (see Settlement.outbox)
        # The fates an aborted transaction learned for its rows (a message the broker refused for good),
        # by row id, for the next attempt at them to park them instead of sending them.
        self._learned: dict[int, Delivery] = {}
        self._suspects: set[int] = set()  # refused together with others: each is tried alone (see plan)
        self._learning = threading.Lock()  # the lanes' threads share both

    def check_mode(self, mode: str) -> None:
        if mode != "log":
            raise RelayConfigurationError(
                "--exactly-once needs log mode, and the outbox is in queue mode (postbox relay switch-mode "
                "log; a queue-mode relay marks each row after its ack, which no Kafka transaction includes)"
            )

    def connected(self, lease_conn: Connection) -> None:
        self.outbox_identity = outbox_identity(lease_conn)
        self.transactions.bind(self._prefix(self.outbox_identity))

    def lease_turn(self, turn: LeaseTurn) -> None:
        """Open the producers of the groups now owned whole, each after its last settlement is read back
        and written where the database lacks it; close those of groups given up. The cursor topic is
        made first, once."""
        transactions = self.transactions
        try:
            transactions.ensure_cursor_topic()
        except (KafkaException, GroupNotReady) as exc:
            log.warning("relay_cursor_topic_unavailable", topic=transactions.cursor_topic, error=str(exc))
            return
        except ValueError as exc:
            raise RelayConfigurationError(str(exc)) from None
        # A group with a shard whose lease lapsed since the last tick may have been another's meanwhile,
        # or have a settlement its database commit lost (a fenced mark): opened again, read back, even when
        # the tick took it straight back.
        for group in groups_in(turn.lost):
            transactions.drop(group)

        def settle(settlement: Settlement) -> bool:
            with turn.lock:
                return write_back(turn.conn, self._claimer, settlement)

        try:
            transactions.sync(whole_groups(turn.owned), settle, turn.keep_leases)
        except ForeignSettlement as exc:
            raise RelayConfigurationError(str(exc)) from None

    def lanes(self, owned: Collection[int], lanes: int) -> list[list[int]]:
        ready = self.transactions.ready
        return split_groups([g for g in whole_groups(owned) if g in ready], lanes)

    def readable(self, lane: list[int]) -> list[int]:
        # A group dropped mid-drain (fenced, failed) is opened again at the tick.
        ready = self.transactions.ready
        return [s for g in groups_in(lane) if g in ready for s in shards_of(g)]

    def begin(self, page: Page, prepared: Prepared, record_acks: bool) -> TransactionRound | None:
        """Plan the batch (which rows it sends, what it writes back), then begin a transaction for each
        group that sends rows, with those rows' messages and the group's settlement; `prepared` is trimmed
        to the rows sent. A group that sends nothing has no transaction: its rows are only parked and its
        cursors moved, in the database alone (none of them reaches Kafka, so no crash can leave Kafka ahead
        of it). None, with every group that began dropped, when a group's producer cannot begin (fenced by
        a newer owner, or failed; it is opened again at the tick)."""
        rows = prepared.rows
        ids = list(map(ROW_ID, rows))
        with self._learning:
            learned = {i: self._learned[i] for i in ids if i in self._learned} if self._learned else None
            suspects = frozenset(i for i in ids if i in self._suspects) if self._suspects else frozenset()
        planned = plan(
            ids,
            list(map(ROW_AGGREGATE_ID, rows)),
            [r.shard for r in rows],
            prepared.deliveries,
            page.read_past,
            learned,
            suspects,
        )
        by_row = dict(zip(prepared.sent, prepared.messages, strict=True))
        prepared.sent, prepared.messages = planned.send, [by_row[i] for i in planned.send]
        sent_by_group: dict[int, list[int]] = {}
        for index in planned.send:
            sent_by_group.setdefault(group_of(rows[index].shard), []).append(index)
        settlements = page.settlements(sent_by_group.keys(), planned.outcome)
        begun: list[GroupTransaction] = []
        for group, sent in sorted(sent_by_group.items()):
            settlement = replace(settlements[group], outbox=self.outbox_identity)
            opened = self.transactions.begin(group, [by_row[i] for i in sent], settlement, record_acks)
            if opened is None:
                # Dropped, not aborted: an abort waits on the broker (up to its timeout each, and no lease
                # is renewed here); the groups' next opening aborts what they left open.
                for other in begun:
                    self.transactions.drop(other.group)
                return None
            begun.append(GroupTransaction(group, opened, sent))
        return TransactionRound(self, planned, begun)

    def not_ready(self, owned: Collection[int]) -> str | None:
        # Every group owned, not only one: a relay that reports ready while some of its groups are still
        # opening holds their events back (a rollout would also stop the replica they came from too soon).
        ready = self.transactions.ready
        waiting = [g for g in whole_groups(owned) if g not in ready]
        if waiting or not ready:
            shown = ", ".join(map(str, waiting)) if waiting else "none owned whole"
            return f"exactly-once: groups not open yet ({shown}; init_transactions and read-back pending)"
        return None

    def disconnected(self) -> None:
        # A batch's Kafka transaction may have committed without its database commit: every group is read
        # back before it publishes again.
        self.transactions.drop_all()

    def close(self) -> None:
        self.transactions.close()

    def learn(self, rows: Sequence[OutboxRow], sent: int, refused: list[tuple[int, Delivery]]) -> None:
        """What an aborted batch's refusals teach its next attempt: a row the broker refused alone is
        parked by the next plan; rows it refused together with others (it answers for a whole request)
        are each tried alone."""
        with self._learning:
            if len(refused) == 1 or sent == 1:  # the broker answered for this row alone
                for index, delivery in refused:
                    self._learned[rows[index].id] = delivery
            else:
                self._suspects.update(rows[index].id for index, _ in refused)
            if len(self._learned) + len(self._suspects) > LEARNED_LIMIT:
                self._learned.clear()
                self._suspects.clear()

    def forget(self, outcome: BatchOutcome) -> None:
        """Rows published or parked need no learned fate any more (a row requeued later is tried anew)."""
        with self._learning:
            if self._learned or self._suspects:
                for row in outcome.rows:
                    if row.state is not RowState.PENDING:
                        self._learned.pop(row.row_id, None)
                        self._suspects.discard(row.row_id)


@dataclass
class GroupTransaction:
    """One group's open Kafka transaction in a batch, with the rows whose messages it holds."""

    group: int
    open: OpenTransaction
    sent: list[int]  # indexes into the batch's rows, in the order of the transaction's messages


@dataclass
class TransactionRound:
    """A batch's plan and a transaction for each of its groups that sends a row. A lane's page spans all
    its groups, so that they wait for their acks and commits together instead of one after another."""

    owner: ExactlyOnce
    plan: Plan
    groups: list[GroupTransaction]

    def wait(self, deliveries: list[Delivery | None], while_waiting: Callable[[], None]) -> None:
        """Every transaction's reports, and each one's settlement's."""
        for group in self.groups:
            reports = self.owner.transactions.wait(group.open, while_waiting)
            for index, report in zip(group.sent, reports, strict=True):
                deliveries[index] = report

    def acks(self) -> list[Ack | None]:
        by_row: dict[int, Ack | None] = {}
        for group in self.groups:
            by_row.update(zip(group.sent, group.open.sending.acks(), strict=True))
        return [by_row.get(index) for index in self.plan.send]

    def settle(
        self, rows: Sequence[OutboxRow], final: list[Delivery], while_waiting: Callable[[], None]
    ) -> BatchOutcome | Rollback:
        """Commit the transactions when every message and settlement was delivered, and return the planned
        outcome for the database to write. Otherwise abort them (nothing of them is visible to
        read_committed consumers) and roll back: the batch is read again, its rows refused for good
        (parked by the broker's word) parked by the plan, the others sent again after a backoff. A commit
        that fails, or whose outcome is unknown, also rolls back: every group of the batch is opened again,
        and its settlement read back (those committed before it included), before it publishes again.
        The leases are renewed between one group's commit or abort and the next (each may wait up to a
        third of the lease on a struggling broker)."""
        transactions = self.owner.transactions
        outcome = self.plan.outcome
        failed = [(i, final[i]) for i in self.plan.send if final[i].disposition is not None]
        settlements = [transactions.settlement_delivered(g.open) for g in self.groups]
        if failed or any(d.disposition is not None for d in settlements):
            return self._abort(rows, failed, settlements, while_waiting)
        for index, group in enumerate(self.groups):
            if index:
                while_waiting()
            if transactions.commit(group.open) is not Ending.COMMITTED:
                # Its producer was dropped (see Transactions.commit); so are the others', committed or not.
                for other in self.groups[:index]:
                    transactions.drop(other.group)
                for other in self.groups[index + 1 :]:
                    while_waiting()
                    transactions.abort(other.open)
                return Rollback(back_off=True)
        self.owner.forget(outcome)
        return outcome

    def _abort(
        self,
        rows: Sequence[OutboxRow],
        failed: list[tuple[int, Delivery]],
        settlements: list[Delivery],
        while_waiting: Callable[[], None],
    ) -> Rollback:
        """Abort the transactions, one of which a message or a settlement did not make (the aborts drop
        the groups' producers: they are opened again, and read back, at the tick); learn what the broker
        refused for good, for the next attempt's plan."""
        endings = set()
        for index, group in enumerate(self.groups):
            if index:
                while_waiting()
            endings.add(self.owner.transactions.abort(group.open))
        refused = [(index, d) for index, d in failed if d.disposition is Disposition.PARK]
        self.owner.learn(rows, len(self.plan.send), refused)
        reasons = {d.reason or "" for _, d in failed} | {d.reason for d in settlements if d.reason}
        log.warning(
            "relay_transaction_aborted",
            groups=[g.group for g in self.groups],
            failed=len(failed),
            reasons=sorted(reasons)[:5],
            ending=sorted(e.value for e in endings),
        )
        return Rollback(back_off=not refused)  # a broker that struggles: back off before the next batch

    def mark_fenced(self) -> None:
        # The batch's settlements are in Kafka and not in the database: whoever opens their groups next
        # (this relay too) reads them back first.
        for group in self.groups:
            self.owner.transactions.drop(group.group)
