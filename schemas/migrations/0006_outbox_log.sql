-- Log mode (`postbox relay run --mode log`): the outbox read as an append-only log in commit order, with
-- no write to any row on the relay's hot path. Queue mode is unchanged by this migration.
--
-- Which mode an outbox is in shows in two places, both changed by `postbox relay switch-mode` in one
-- transaction: the default of outbox.state, which is what writers get ('pending' in queue mode: the relay
-- claims each row and marks it published; 'logged' in log mode: the relay reads rows in windows between
-- snapshots and moves a cursor per shard; writers never set the state, so they do not change), and the
-- outbox_mode row, which is what relays read.
--
-- How log mode reads in commit order (PgQ's method): a tick stores pg_current_snapshot(). The rows of the
-- window between two ticks are those whose writing transaction had finished at the later tick and had not
-- at the earlier one: every committed row is in exactly one window, whenever it commits (a transaction
-- that commits minutes late, a prepared transaction, a rolled-back one that never shows), and a
-- transaction still open holds back nobody else's rows.

ALTER TABLE outbox DROP CONSTRAINT outbox_state_valid;
ALTER TABLE outbox ADD CONSTRAINT outbox_state_valid CHECK (state IN ('pending', 'published', 'failed', 'logged'));

-- The writing transaction's id (the top-level one, also inside a savepoint), as the snapshots know it.
-- A stable default: rows that exist already take this migration's id (no table rewrite); only rows
-- written in log mode ('logged') are ever read by it.
ALTER TABLE outbox ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id();

-- Finds a window's rows (to bound its id range) without reading any row outside it. Partial: in queue
-- mode writers pay nothing for it, and in log mode they pay it instead of outbox_pending_idx.
CREATE INDEX outbox_log_idx ON outbox (txid) WHERE state = 'logged';

-- Ticks: snapshots taken one at a time (under an advisory lock), so ticks and snapshots are in the same
-- order. Old ticks are deleted once every shard's cursor has passed them.
CREATE TABLE outbox_tick (
    tick     bigint PRIMARY KEY,
    snapshot pg_snapshot NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Log mode's progress, one row per shard. tick: every row of the shard visible in this tick's snapshot
-- has been published. A window in progress (window_to not null): the rows of the window (tick,
-- window_to] with id <= last_id have been published, and none of the window's rows has an id over max_id.
-- Advanced once per batch, fenced on the shard's lease.
CREATE TABLE outbox_cursor (
    shard      integer PRIMARY KEY CHECK (shard BETWEEN 0 AND 63),
    tick       bigint,
    window_to  bigint,
    last_id    bigint,
    max_id     bigint,
    updated_at timestamptz
);
INSERT INTO outbox_cursor (shard) SELECT generate_series(0, 63);

-- The last switch (no row: never switched, queue mode). After a switch back to queue mode, a shard's
-- pending rows are claimed only once its cursor has reached the switch's tick: the logged rows written
-- before the switch go out first. In log mode, a shard with pending rows (from before the switch, or
-- requeued) is not read from the log until they are claimed.
CREATE TABLE outbox_mode (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    mode        text NOT NULL CHECK (mode IN ('queue', 'log')),
    tick        bigint NOT NULL,
    switched_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
