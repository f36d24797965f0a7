"""How a batch's messages reach Kafka, and when the relay may write their outcome: the relay's delivery
guarantee, behind one seam, so that the relay loop (daemon.py) knows none.

- At least once (the default, here): every lane's batches go through the relay's one producer; a row is
  marked once its message is acked. A crash between the two sends it again (a duplicate with the same
  message id, never a loss).
- Exactly once (--exactly-once, exactly_once/delivery.py): a batch is a Kafka transaction per group of
  shards, with the cursors it moves, committed before the database is written.

The loop asks a guarantee how shards are leased and dealt to lanes, hands it each page to send, and asks
the batch it returns for the reports and for the outcome to write (or to roll the batch back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from postbox.relay.outbox.outcome import BatchOutcome, Delivery, decide
from postbox.relay.outbox.shares import split_lanes
from postbox.relay.outbox.sources.base import Connection

if TYPE_CHECKING:
    from postbox.relay.outbox.batch import Prepared
    from postbox.relay.outbox.publisher import Ack, Publisher, Sending
    from postbox.relay.outbox.routing import OutboxRow
    from postbox.relay.outbox.sources.base import Page

# map with an attrgetter: about half a list comprehension's cost per row
ROW_ID, ROW_AGGREGATE_ID = attrgetter("id"), attrgetter("aggregate_id")


@dataclass(frozen=True)
class Rollback:
    """A batch whose outcome must not be written: its database transaction is rolled back and its rows
    read again (after a backoff when `back_off`: the broker struggles)."""

    back_off: bool


@dataclass(frozen=True)
class LeaseTurn:
    """A lease tick, with no batch in flight: what a guarantee may act on there."""

    conn: Connection  # the lease connection (autocommit), shared with the lanes' log ticks...
    lock: threading.Lock  # ...under this lock
    owned: frozenset[int]  # the shards leased now
    lost: frozenset[int]  # the shards whose lease lapsed since the tick before
    keep_leases: Callable[[], None]  # renews the leases: call it while waiting on a broker


class SentBatch(Protocol):
    """A batch's messages with the producer, its database transaction still open."""

    def wait(self, deliveries: list[Delivery | None], while_waiting: Callable[[], None]) -> None:
        """Fill in `deliveries` (one per row of the batch) from the messages' reports, as they come;
        `while_waiting` is called regularly meanwhile."""
        ...

    def acks(self) -> list[Ack | None]:
        """Where and when each message sent landed, in the order of the batch's `sent` (for the publish
        spans, after `wait`)."""
        ...

    def settle(
        self, rows: Sequence[OutboxRow], final: list[Delivery], while_waiting: Callable[[], None]
    ) -> BatchOutcome | Rollback:
        """The outcome to write in the database, each row's delivery known (`final`), or a rollback;
        `while_waiting` is called between the steps that wait on a broker."""
        ...

    def mark_fenced(self) -> None:
        """The batch's outcome was written only in part: a shard's lease lapsed meanwhile."""
        ...


class DeliveryGuarantee(Protocol):
    lease_group: int  # shards leased together (a relay takes and gives them as one)

    def check_mode(self, mode: str) -> None:
        """Raise RelayConfigurationError when this guarantee cannot be given reading the outbox so."""
        ...

    def connected(self, lease_conn: Connection) -> None:
        """At each connect, before the first lease tick."""
        ...

    def lease_turn(self, turn: LeaseTurn) -> None:
        """At each lease tick, before the lanes drain."""
        ...

    def lanes(self, owned: Collection[int], lanes: int) -> list[list[int]]:
        """The shards each lane reads this drain (at most `lanes` lists, disjoint)."""
        ...

    def readable(self, lane: list[int]) -> list[int]:
        """Of a lane's shards, those a batch may read now (a lane's may shrink mid-drain)."""
        ...

    def begin(self, page: Page, prepared: Prepared, record_acks: bool) -> SentBatch | None:
        """Hand the page's messages to Kafka. `prepared.sent` and `prepared.messages` may be trimmed to
        those actually sent. None when nothing could be sent: the batch is rolled back and read again
        after the next lease tick."""
        ...

    def not_ready(self, owned: Collection[int]) -> str | None:
        """Why the relay cannot publish (all of) the shards it owns yet, if it is this guarantee's doing."""
        ...

    def disconnected(self) -> None:
        """The relay lost, or closed, its database connections."""
        ...

    def close(self) -> None: ...


class AtLeastOnce:
    """The relay's one producer, shared by every lane; a row is marked once its message is acked."""

    lease_group = 1

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    def check_mode(self, mode: str) -> None:
        pass

    def connected(self, lease_conn: Connection) -> None:
        pass

    def lease_turn(self, turn: LeaseTurn) -> None:
        pass

    def lanes(self, owned: Collection[int], lanes: int) -> list[list[int]]:
        return split_lanes(sorted(owned), lanes)

    def readable(self, lane: list[int]) -> list[int]:
        return lane

    def begin(self, page: Page, prepared: Prepared, record_acks: bool) -> Published:
        messages = prepared.messages
        return Published(
            self._publisher.send(messages, record_acks=record_acks) if messages else None, prepared.sent
        )

    def not_ready(self, owned: Collection[int]) -> str | None:
        return None

    def disconnected(self) -> None:
        pass

    def close(self) -> None:
        pass  # the publisher is the relay's: it closes it


@dataclass
class Published:
    """An at-least-once batch: its messages' reports, whatever they say, decide its outcome."""

    sending: Sending | None  # None: nothing to send
    sent: list[int]  # indexes into the batch's rows of the messages sent

    def wait(self, deliveries: list[Delivery | None], while_waiting: Callable[[], None]) -> None:
        if self.sending is not None:
            for index, report in zip(self.sent, self.sending.wait(while_waiting), strict=True):
                deliveries[index] = report

    def acks(self) -> list[Ack | None]:
        return self.sending.acks() if self.sending is not None else []

    def settle(
        self, rows: Sequence[OutboxRow], final: list[Delivery], while_waiting: Callable[[], None]
    ) -> BatchOutcome:
        return decide(list(map(ROW_ID, rows)), list(map(ROW_AGGREGATE_ID, rows)), final)

    def mark_fenced(self) -> None:
        pass  # the rows not marked are still pending: the shard's next owner sends them again
