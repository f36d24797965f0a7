"""What one exactly-once batch writes back, carried in its Kafka transaction, and which of its rows it
sends. Pure.

A batch's transaction holds its messages and one record, the settlement: the cursor moves of its shards
(each from where PostgreSQL had it when the batch began), the rows it parks, and, for rows claimed one by
one (pending rows in a log-mode outbox), each row's new state. PostgreSQL is written after the commit. A
crash between the two leaves Kafka ahead; whoever owns the group next (the same relay after a restart, or
another) reads the last settlement back and writes whatever of it PostgreSQL lacks (transactions.py):
a cursor only if it still stands where the batch found it, a row only if it is still unpublished.

Which rows to send follows from the same plan: a row is sent only if the settlement marks it published
once every message sent is delivered. A row whose fate was known before sending (parked, held for a
topic, behind an earlier row of its shard) is never in the transaction, so no message is ever committed
whose row would be read again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from postbox.relay.outbox.errors import Disposition
from postbox.relay.outbox.outcome import DELIVERED, BatchOutcome, Delivery, RowOutcome, RowState, decide
from postbox.relay.outbox.sources.log_cursors import Cursor, CursorMove

FORMAT = 1
# A parked row's reason is cut to this in the record, which must stay below message.max.bytes whatever
# the batch parks: reasons are written once per distinct reason (_encode_outcomes), and quote no row.
REASON_CHARS = 200
MAX_BYTES = 256 * 1024  # far below any message.max.bytes a cluster sets
HELD_IN_SHARD = "held back behind an earlier row of its shard, not sent in this transaction"
TRIED_ALONE = "waits while a row the broker refused together with others is tried alone"


class SettlementError(ValueError):
    """A record on the cursor topic that is not a settlement this relay can read."""


@dataclass(frozen=True)
class Settlement:
    group: int
    relay_id: str
    # Which outbox it settles, and which copy of it: "<outbox id>/<cursor table oid>" (write_back.py).
    outbox: str = ""
    moves: tuple[CursorMove, ...] = ()
    parked: tuple[RowOutcome, ...] = ()  # rows of a window parked (held ones with held_for)
    marked: tuple[RowOutcome, ...] = field(default=())  # rows claimed one by one: published or parked

    def encode(self) -> bytes:
        """The record's value: JSON, at most MAX_BYTES whatever the rows' reasons (cut shorter, then left
        out, when long and many: the database gets each row's whole reason from the batch itself; the
        settlement's copy serves only a write-back after a crash)."""
        for reason_chars in (REASON_CHARS, 40, 0):
            value = self._encode(reason_chars)
            if len(value) <= MAX_BYTES:
                return value
        return value  # ids alone: 4,000 rows' take some 50 KB

    def _encode(self, reason_chars: int) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT,
            "group": self.group,
            "relay_id": self.relay_id,
            "outbox": self.outbox,
            "moves": [[m.shard, _cursor(m.before), _cursor(m.after)] for m in self.moves],
            "parked": _encode_outcomes(self.parked, reason_chars),
            "marked": _encode_outcomes(self.marked, reason_chars),
        }
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def decode(value: bytes | None) -> Settlement:
    """The settlement in a record of the cursor topic; SettlementError when it is not one."""
    try:
        body = json.loads(value or b"")
        if not isinstance(body, dict) or type(body.get("format")) is not int or body["format"] != FORMAT:
            raise SettlementError(f"not a settlement of format {FORMAT}")
        moves = tuple(
            CursorMove(_integer(shard), _uncursor(shard, before), _uncursor(shard, after))
            for shard, before, after in body["moves"]
        )
        return Settlement(
            _integer(body["group"]),
            _text(body["relay_id"]),
            _text(body["outbox"]),
            moves,
            _decode_outcomes(body["parked"]),
            _decode_outcomes(body["marked"]),
        )
    except SettlementError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise SettlementError(f"not a readable settlement: {type(exc).__name__}: {exc}") from None


def _cursor(cursor: Cursor) -> list[int | None]:
    return [cursor.tick, cursor.window_to, cursor.last_id, cursor.max_id]


def _uncursor(shard: int, fields: Sequence[Any]) -> Cursor:
    tick, window_to, last_id, max_id = fields
    return Cursor(
        shard, _integer(tick), *(None if v is None else _integer(v) for v in (window_to, last_id, max_id))
    )


def _encode_outcomes(outcomes: Sequence[RowOutcome], reason_chars: int = REASON_CHARS) -> list[list[Any]]:
    """Grouped by (state, reason, held_for): a batch parks its rows mostly for one reason, and a reason is
    written once with the ids it holds for."""
    grouped: dict[tuple[str, str | None, str | None], list[int]] = {}
    for o in outcomes:
        reason = None if o.error is None else o.error[:reason_chars] if reason_chars else "(see the row)"
        grouped.setdefault((o.state.value, reason, o.held_for), []).append(o.row_id)
    return [[state, reason, held_for, ids] for (state, reason, held_for), ids in grouped.items()]


def _decode_outcomes(groups: Sequence[Any]) -> tuple[RowOutcome, ...]:
    return tuple(
        RowOutcome(_integer(row_id), RowState(state), _text_or_none(reason), _text_or_none(held_for))
        for state, reason, held_for, ids in groups
        for row_id in ids
    )


def _integer(value: Any) -> int:
    """JSON's integer, nothing converted (a float, a bool or a string in its place is no settlement's)."""
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not text")
    return value


def _text_or_none(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{value!r} is not text")
    return value


@dataclass(frozen=True)
class Plan:
    outcome: BatchOutcome  # what the batch writes once every message sent is delivered
    send: list[int]  # indexes into the rows: the rows whose messages go into the transaction


def plan(
    row_ids: Sequence[int],
    aggregates: Sequence[str],
    shards: Sequence[int],
    known: Sequence[Delivery | None],
    read_past: bool,
    learned: Mapping[int, Delivery] | None = None,
    suspects: Set[int] = frozenset(),
) -> Plan:
    """Which rows to send, and the batch's outcome if every message sent is delivered.

    `known[i]`: row i's fate known before sending (None: to be sent). `learned`: fates found by an earlier
    attempt at the same rows whose transaction was aborted (a message the broker refused, alone, for
    good), by row id. `suspects`: rows the broker refused together with others in one request (it answers
    for the request, so which of them is at fault is not known): the first is sent alone, in a
    transaction of its own, once it is the page's first row; until then the page is sent up to it.

    A row is sent only if the outcome marks it published: never one behind a row to retry in its
    aggregate, nor, on a page read past by a cursor, in its shard (the cursor stops before that row, and
    the rows after it are read again)."""
    fates = [
        (learned.get(row_id, DELIVERED) if learned else DELIVERED) if d is None else d
        for row_id, d in zip(row_ids, known, strict=True)
    ]
    if suspects:
        first = next((i for i, r in enumerate(row_ids) if r in suspects and known[i] is None), None)
        if first is not None:
            for index in range(len(fates)) if first == 0 else range(first, len(fates)):
                if index != 0 and known[index] is None:
                    fates[index] = Delivery(Disposition.RETRY, TRIED_ALONE)
    outcome = decide(row_ids, aggregates, fates)
    if read_past and outcome.retried:
        stopped: set[int] = set()
        demoted = False
        for index, (shard, row) in enumerate(zip(shards, outcome.rows, strict=True)):
            if row.state is RowState.PENDING:
                stopped.add(shard)
            elif row.state is RowState.PUBLISHED and shard in stopped:
                fates[index] = Delivery(Disposition.RETRY, HELD_IN_SHARD)
                demoted = True
        if demoted:
            outcome = decide(row_ids, aggregates, fates)
    send = [i for i, row in enumerate(outcome.rows) if row.state is RowState.PUBLISHED]
    return Plan(outcome, send)
