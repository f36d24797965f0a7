-- The relay's SQL, loaded by name (relay.core.sql). Unqualified names: search_path selects the schema.

-- name: claim_batch
-- Rows of the shards this replica owns, in id order. The advisory lock per shard (held to the end of the
-- transaction) keeps a replica whose lease has just expired and the one taking over from draining the same
-- shard at once: a shard whose lock is taken is left out of this batch entirely, so SKIP LOCKED can never
-- skip an earlier row of an aggregate and publish a later one first.
-- ORDER BY id, shard (the same order as by id alone: ids are unique) matches only outbox_pending_idx
-- (id, shard), never the primary key; with lane_session's settings that makes this index, with the shard
-- filter inside it, the only plan. Left to the statistics, the planner picks a bitmap scan of every
-- pending row plus a sort right after a bulk insert (statistics say the table is small), or the primary
-- key past every published row after an ANALYZE taken mid-backlog (statistics say every row is pending):
-- both cost a claim tens to hundreds of milliseconds on a large backlog instead of a few.
-- Memory: the relay receives a prefix of the claimed rows (in id order, so order holds) whose messages
-- add up to at most max_batch_bytes (the first row always comes), and a row over max_message_bytes
-- comes without its payload, headers and long text: it is parked, never loaded whole. Sizes come from
-- message_bytes, computed when the row was written (migration 0005). Rows past the prefix stay pending
-- (locked until this transaction ends) for the next batch; claimed_rows tells the relay how many the
-- claim took, so a cut batch counts as full. The window's sort is of the claimed rows only (at most
-- `limit`, already in order), never of the backlog.
-- The id as text and empty headers as NULL spare the relay a UUID object and a JSON parse for every row.
-- The columns are named as relay.outbox.sources.base.OutboxRecord's fields, which every read checks.
WITH claimed AS MATERIALIZED (
    -- Materialized with the payload still in its stored form (toasted values stay pointers): only the
    -- rows returned below are ever converted to text.
    SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic,
           shard, created_at, message_bytes, (message_bytes <= %(max_message_bytes)s) AS fits
    FROM outbox
    WHERE state = 'pending'
      AND shard = ANY (ARRAY(
            SELECT s FROM unnest(%(shards)s::integer[]) AS s
            WHERE pg_try_advisory_xact_lock(%(lock_space)s, s)))
      AND NOT (coalesce(topic, '') = ANY (%(blocked_topics)s::text[]))
      AND NOT (topic IS NULL AND aggregate_type = ANY (%(blocked_types)s::text[]))
      -- Switched back from log mode: a shard's pending rows wait until its cursor has read the log to
      -- the switch (outbox_mode, migration 0006). Never switched, or in log mode: no condition.
      AND (coalesce((SELECT m.mode FROM outbox_mode AS m), 'log') = 'log'
           OR shard = ANY (ARRAY(SELECT c.shard FROM outbox_cursor AS c
                                 WHERE c.tick >= (SELECT m.tick FROM outbox_mode AS m))))
    ORDER BY id, shard
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), budgeted AS (
    SELECT c.*,
           sum(CASE WHEN c.fits THEN c.message_bytes ELSE 0 END)
               OVER (ORDER BY c.id, c.shard ROWS UNBOUNDED PRECEDING) AS running,
           count(*) OVER () AS claimed_rows
    FROM claimed AS c
)
SELECT id, event_id::text AS event_id,
       CASE WHEN fits THEN aggregate_type ELSE left(aggregate_type, 200) END AS aggregate_type,
       CASE WHEN fits THEN aggregate_id ELSE left(aggregate_id, 200) END AS aggregate_id,
       CASE WHEN fits THEN event_type ELSE left(event_type, 200) END AS event_type,
       CASE WHEN fits THEN payload::text END AS payload,
       CASE WHEN fits THEN payload_bytes END AS payload_bytes,
       CASE WHEN fits THEN nullif(headers, '{}'::jsonb) END AS headers,
       CASE WHEN fits THEN topic ELSE left(topic, 200) END AS topic,
       shard, extract(epoch FROM created_at)::float8 AS created_epoch, message_bytes AS size, claimed_rows
FROM budgeted
WHERE running - CASE WHEN fits THEN message_bytes ELSE 0 END < %(max_batch_bytes)s
ORDER BY id, shard

-- name: lane_session
-- Run once on each lane connection, which runs only the claim, the mark statements and prune_batch.
-- A disabled plan type is still used where nothing else can answer, so no statement can fail for these.
-- synchronous_commit off: a lane's commit (the mark) returns without waiting for the WAL flush, which under
-- a busy writer load cost each batch 10 ms at the median and 30-40 ms at p99, and the lane's next claim
-- waited for it. Safe for delivery: the messages were acknowledged before the mark, and a mark that a
-- crash of PostgreSQL loses (the last few hundred milliseconds at most) leaves its rows pending, so they
-- are published again: duplicates with the same message ids, which at-least-once allows. Writers' commits
-- keep their own setting; nothing a writer commits can be lost this way.
SELECT set_config('enable_sort', 'off', false),
       set_config('enable_incremental_sort', 'off', false),
       set_config('enable_bitmapscan', 'off', false),
       set_config('synchronous_commit', 'off', false)

-- name: mark_batch
-- One statement for the whole batch: published, parked (failed) and to-retry rows, each with its reason.
-- The fence: only rows of shards whose lease this replica still holds (by the database clock) change.
-- Only pending rows: the batch's own are (it holds their locks); an exactly-once relay writing a batch's
-- settlement back after a crash (relay.outbox.exactly_once) must not touch a row marked since.
WITH outcome AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(states)s::text[], %(errors)s::text[]) AS o(id, state, error)
), held AS (
    SELECT shard FROM outbox_shard_lease
    WHERE owner = %(relay_id)s AND expires_at > clock_timestamp()
)
UPDATE outbox AS t
SET state        = o.state,
    published_at = CASE WHEN o.state = 'published' THEN clock_timestamp() END,
    attempts     = least(t.attempts, 2147483646) + 1,  -- a writer's absurd value must not fail the mark
    last_error   = o.error
FROM outcome AS o
WHERE t.id = o.id AND t.state = 'pending' AND t.shard IN (SELECT shard FROM held)
RETURNING t.id

-- name: mark_batch_deleting
-- mark_batch for --delete-on-publish: published rows are deleted instead of updated (a delete writes no
-- new row version and no index entries, where the update copies the whole row, payload included); parked
-- and to-retry rows are updated as in mark_batch, under the same fence. A statement of its own because
-- PostgreSQL checks the DELETE privilege for a DELETE anywhere in a statement, even one that deletes nothing.
WITH outcome AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(states)s::text[], %(errors)s::text[]) AS o(id, state, error)
), held AS (
    SELECT shard FROM outbox_shard_lease
    WHERE owner = %(relay_id)s AND expires_at > clock_timestamp()
), deleted AS (
    DELETE FROM outbox AS t
    USING outcome AS o
    WHERE o.state = 'published' AND t.id = o.id AND t.state = 'pending' AND t.shard IN (SELECT shard FROM held)
    RETURNING t.id
), updated AS (
    UPDATE outbox AS t
    SET state      = o.state,
        attempts   = least(t.attempts, 2147483646) + 1,
        last_error = o.error
    FROM outcome AS o
    WHERE o.state <> 'published' AND t.id = o.id AND t.state = 'pending' AND t.shard IN (SELECT shard FROM held)
    RETURNING t.id
)
SELECT id FROM deleted UNION ALL SELECT id FROM updated

-- name: may_delete
-- --delete-on-publish needs DELETE on the outbox, which the least-privilege relay role lacks.
SELECT has_table_privilege('outbox', 'DELETE')

-- name: may_maintain_partitions
-- Every relay keeps the outbox's partitions ahead of the txids in use, through this SECURITY DEFINER
-- function, and reports them (status, the partitions gauge) from outbox_partition.
SELECT has_function_privilege('outbox_maintain_partitions(bigint, interval)', 'EXECUTE')
       AND has_table_privilege('outbox_partition', 'SELECT')

-- name: lock_relay_id
-- A session lock on the lease connection for as long as the replica is connected: a second replica
-- started with the same relay id waits instead of sharing (and, when it stops, releasing) its leases.
SELECT pg_try_advisory_lock(%(key)s)

-- name: end_stale_relay_id_holder
-- The relay id's lock is held, but no replica of that id has heartbeaten within the lease time: the
-- holder is this replica's own session from before a network cut (the server has not noticed that it is
-- gone, and would not for hours) or a replica that hangs. End it, as a takeover ends an expired member's
-- sessions; a live replica of the same id heartbeats, so it is never ended here.
SELECT count(*) FILTER (WHERE pg_terminate_backend(l.pid))
FROM pg_locks AS l
JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.classid = %(high)s::bigint::oid AND l.objid = %(low)s::bigint::oid
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND a.application_name = left('postbox-relay ' || %(relay_id)s, 63)
  AND l.pid <> pg_backend_pid()
  AND NOT EXISTS (
        SELECT 1 FROM outbox_relay_member AS m
        WHERE m.relay_id = %(relay_id)s AND m.last_seen >= clock_timestamp() - %(ttl)s::interval)

-- name: heartbeat
INSERT INTO outbox_relay_member (relay_id, last_seen, backend_pid)
VALUES (%(relay_id)s, clock_timestamp(), pg_backend_pid())
ON CONFLICT (relay_id) DO UPDATE SET last_seen = clock_timestamp(), backend_pid = pg_backend_pid()

-- name: live_members
-- Members seen within the lease time; the long-gone are forgotten on the way.
WITH gone AS (
    DELETE FROM outbox_relay_member
    WHERE last_seen < clock_timestamp() - 10 * %(ttl)s::interval
)
SELECT relay_id FROM outbox_relay_member WHERE last_seen >= clock_timestamp() - %(ttl)s::interval

-- name: fence_expired_members
-- A replica whose heartbeat stopped (crashed, paused, cut off) may still have a session holding row locks
-- and shard advisory locks in an open batch. End its sessions, found by the application_name every relay
-- connection carries, so its shards move within the lease time instead of waiting for server timeouts.
SELECT m.relay_id, count(a.pid) FILTER (WHERE pg_terminate_backend(a.pid))
FROM outbox_relay_member AS m
JOIN pg_stat_activity AS a ON a.application_name = left('postbox-relay ' || m.relay_id, 63)
WHERE m.last_seen < clock_timestamp() - %(ttl)s::interval
  AND m.relay_id <> %(relay_id)s
  AND a.pid <> pg_backend_pid()
GROUP BY m.relay_id

-- name: renew_leases
UPDATE outbox_shard_lease
SET expires_at = clock_timestamp() + %(ttl)s::interval
WHERE owner = %(relay_id)s AND expires_at > clock_timestamp()
RETURNING shard

-- name: acquire_leases
UPDATE outbox_shard_lease AS l
SET owner = %(relay_id)s, expires_at = clock_timestamp() + %(ttl)s::interval, acquired_at = clock_timestamp()
WHERE l.shard IN (
    SELECT shard FROM outbox_shard_lease
    WHERE owner IS NULL OR expires_at <= clock_timestamp()
    ORDER BY shard
    LIMIT %(wanted)s
    FOR UPDATE SKIP LOCKED)
RETURNING l.shard

-- name: acquire_lease_groups
-- Exactly-once: whole groups of shards (shard / group_shards), each only when every shard of it is free,
-- so that one replica's transactional producer speaks for a group (relay.outbox.exactly_once.groups).
WITH free AS MATERIALIZED (
    SELECT shard FROM outbox_shard_lease
    WHERE owner IS NULL OR expires_at <= clock_timestamp()
    ORDER BY shard
    FOR UPDATE SKIP LOCKED
), whole AS (
    SELECT shard / %(group_shards)s AS grp FROM free
    GROUP BY 1 HAVING count(*) = %(group_shards)s
    ORDER BY 1
    LIMIT %(wanted)s
)
UPDATE outbox_shard_lease AS l
SET owner = %(relay_id)s, expires_at = clock_timestamp() + %(ttl)s::interval, acquired_at = clock_timestamp()
WHERE l.shard IN (SELECT f.shard FROM free AS f WHERE f.shard / %(group_shards)s IN (SELECT grp FROM whole))
RETURNING l.shard

-- name: release_leases
-- These shards' leases, given back (exactly-once: the shards of a group held only in part).
UPDATE outbox_shard_lease SET owner = NULL, expires_at = NULL
WHERE owner = %(relay_id)s AND shard = ANY (%(shards)s::integer[])
RETURNING shard

-- name: release_some_leases
UPDATE outbox_shard_lease
SET owner = NULL, expires_at = NULL
WHERE shard IN (
    SELECT shard FROM outbox_shard_lease WHERE owner = %(relay_id)s ORDER BY shard DESC LIMIT %(count)s)
RETURNING shard

-- name: release_all_leases
UPDATE outbox_shard_lease SET owner = NULL, expires_at = NULL WHERE owner = %(relay_id)s

-- name: leave
DELETE FROM outbox_relay_member WHERE relay_id = %(relay_id)s

-- name: backlog
-- Pending rows (count, oldest) and parked ones. One subquery per state, each matching its partial index:
-- with `state IN (...)` the planner read every row of a fresh partition (a parallel scan of 1,000,000
-- logged rows took about 90 ms, on every lease tick of every relay).
SELECT p.rows, coalesce(extract(epoch FROM clock_timestamp() - p.oldest), 0),
       (SELECT count(*) FROM outbox WHERE state = 'failed')
FROM (SELECT count(*) AS rows, min(created_at) AS oldest FROM outbox WHERE state = 'pending') AS p

-- name: partitions
-- The outbox's partitions by txid (migration 0007): those in use or ahead, and the finished ones waiting
-- for the retention (emptied and dropped by pruning).
SELECT count(*) FILTER (WHERE xid_to IS NOT NULL AND emptied_at IS NULL),
       count(*) FILTER (WHERE xid_to IS NOT NULL AND emptied_at IS NULL AND done_at IS NOT NULL)
FROM outbox_partition

-- name: shard_owners
SELECT owner, count(*), min(extract(epoch FROM expires_at - clock_timestamp()))
FROM outbox_shard_lease
WHERE owner IS NOT NULL AND expires_at > clock_timestamp()
GROUP BY owner
ORDER BY owner

-- name: unowned_shards
SELECT count(*) FROM outbox_shard_lease WHERE owner IS NULL OR expires_at <= clock_timestamp()

-- name: failed_rows
SELECT id, event_id, aggregate_type, aggregate_id, event_type, attempts, last_error
FROM outbox WHERE state = 'failed' ORDER BY id LIMIT %(limit)s

-- name: requeue
-- Parked rows back to pending. Every filter that is given must match (NULL means "any").
UPDATE outbox
SET state = 'pending', last_error = 'requeued after: ' || coalesce(last_error, ''), held_for = NULL
WHERE state = 'failed'
  AND (%(ids)s::bigint[] IS NULL OR id = ANY (%(ids)s::bigint[]))
  AND (%(aggregate_type)s::text IS NULL OR aggregate_type = %(aggregate_type)s::text)
  AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
  AND (%(error_like)s::text IS NULL OR last_error LIKE %(error_like)s::text)
RETURNING id

-- name: prune_batch
-- One small batch of published rows past the retention; never a pending or parked row.
DELETE FROM outbox
WHERE id IN (
    SELECT id FROM outbox
    WHERE state = 'published' AND published_at < clock_timestamp() - %(retention)s::interval
    ORDER BY id
    LIMIT %(limit)s
    -- Two replicas pruning at once take different rows instead of waiting for (or deadlocking on) each other.
    FOR UPDATE SKIP LOCKED)

-- Log mode (--mode log; schemas/migrations/0006_outbox_log.sql says how it reads in commit order).

-- name: log_mode_of_outbox
SELECT coalesce((SELECT mode = 'log' FROM outbox_mode), false)

-- name: log_lock_cursors
-- The cursors of the lane's shards that no other open batch holds (the row locks last to the end of the
-- batch's transaction: a shard is in one open batch at a time). In log mode a shard with pending rows
-- (older than its logged ones: from before the switch, or requeued) waits until they are claimed.
-- Alongside, on every row: the newest tick, and whether any shard of the lane has pending rows (the
-- relay claims those first).
SELECT c.shard, c.tick, c.window_to, c.last_id, c.max_id,
       (SELECT t.tick FROM outbox_tick AS t ORDER BY t.tick DESC LIMIT 1),
       EXISTS (SELECT FROM outbox AS o WHERE o.state = 'pending' AND o.shard = ANY (%(shards)s::integer[]))
FROM outbox_cursor AS c
WHERE c.shard = ANY (%(shards)s::integer[]) AND c.tick IS NOT NULL
  AND NOT (coalesce((SELECT m.mode FROM outbox_mode AS m), 'queue') = 'log'
           AND c.shard = ANY (ARRAY(SELECT DISTINCT o.shard FROM outbox AS o WHERE o.state = 'pending')))
ORDER BY c.shard
FOR UPDATE OF c SKIP LOCKED

-- name: log_tick_lock
-- Ticks are taken one at a time, so a later tick always has a later snapshot. The snapshot is taken by
-- the next statement (READ COMMITTED takes one per statement), after this lock is held.
SELECT pg_advisory_xact_lock(%(key)s)

-- name: log_try_tick_lock
-- The relay's way to the same lock: it never waits for it. The holder may be a replica stopped between
-- this lock and its commit (SIGSTOP, a VM pause); a lane waiting behind it would hold up the lease tick
-- that ends the stopped replica's sessions, and so wait for the server's idle timeout.
-- The tick commits with the WAL flushed (the session's synchronous_commit), never asynchronously: a relay
-- keeps ticks in memory across a reconnect (their snapshots, cursors passed to them), so a tick that a
-- crash of PostgreSQL lost, its id handed out again with a later snapshot, would make it skip the rows
-- committed between the two snapshots. The 60-second log-mode soak lost rows so (2026-12-07).
SELECT pg_try_advisory_xact_lock(%(key)s)

-- name: log_newest_tick
SELECT tick FROM outbox_tick ORDER BY tick DESC LIMIT 1

-- name: log_take_tick
-- A new tick, unless one was taken less than min_age ago (many lanes and replicas ask at once); returns
-- the tick taken (NULL if none) and the newest one before it. Only the newest tick is read (ticks are
-- taken in order): deleted ticks' dead versions, which a long transaction anywhere keeps from vacuum, are
-- not scanned.
WITH newest AS (
    SELECT tick, taken_at FROM outbox_tick ORDER BY tick DESC LIMIT 1
), taken AS (
    INSERT INTO outbox_tick (tick, snapshot)
    SELECT coalesce(max(tick), 0) + 1, pg_current_snapshot()
    FROM newest
    HAVING coalesce(max(taken_at) <= clock_timestamp() - %(min_age)s::interval, true)
    RETURNING tick
)
SELECT (SELECT tick FROM taken), (SELECT tick FROM newest)

-- name: log_snapshots
-- A window's two snapshots, taken apart for log_window_bounds' index conditions.
SELECT p.snapshot::text, pg_snapshot_xmax(p.snapshot)::text, array(SELECT pg_snapshot_xip(p.snapshot))::text[],
       c.snapshot::text, pg_snapshot_xmax(c.snapshot)::text, pg_snapshot_xmin(p.snapshot)::text
FROM outbox_tick AS p, outbox_tick AS c
WHERE p.tick = %(tick)s AND c.tick = %(window_to)s

-- name: log_window_bounds
-- The id range of a window's rows in some shards: rows whose transaction had finished at the later
-- snapshot (cur) and not at the earlier one (prev), i.e. started at or after prev's xmax or in progress
-- at prev. Read per transaction on outbox_log_idx (txid, id), never row by row: the window's txids at or
-- after prev's xmax by a skip scan (one index descent per transaction), prev's in-progress ones from the
-- snapshot, then each finished one's lowest id in these shards from the start of its entries and, only
-- where it has one, its highest from the end. The pages then walk the primary key over this range.
WITH RECURSIVE txids AS (
    (SELECT txid FROM outbox
     WHERE state = 'logged' AND txid >= %(prev_xmax)s::xid8 AND txid < %(cur_xmax)s::xid8
     ORDER BY txid LIMIT 1)
    UNION ALL
    SELECT (SELECT o.txid FROM outbox AS o
            WHERE o.state = 'logged' AND o.txid > t.txid AND o.txid < %(cur_xmax)s::xid8
            ORDER BY o.txid LIMIT 1)
    FROM txids AS t
    WHERE t.txid IS NOT NULL
), finished AS (
    SELECT txid FROM txids WHERE txid IS NOT NULL
    UNION
    SELECT unnest(%(prev_xip)s::text[]::xid8[])
), lows AS (
    SELECT f.txid,
           (SELECT min(o.id) FROM outbox AS o
            WHERE o.state = 'logged' AND o.txid = f.txid AND o.shard = ANY (%(shards)s::integer[])) AS low
    FROM finished AS f
    WHERE pg_visible_in_snapshot(f.txid, %(cur)s::pg_snapshot)
)
SELECT min(l.low),
       max((SELECT max(o.id) FROM outbox AS o
            WHERE o.state = 'logged' AND o.txid = l.txid AND o.shard = ANY (%(shards)s::integer[])))
FROM lows AS l
WHERE l.low IS NOT NULL

-- name: log_read
-- The next page of a window in id order: rows with id past their shard's last_id, up to the window's
-- max_id, written by a transaction that finished between the two snapshots. Ids within a window follow
-- the order of the writes: a transaction that wrote after another committed has the higher ids. The
-- byte budget and the unloaded oversized rows are claim_batch's, and so are the columns returned, by name
-- (relay.outbox.sources.base.OutboxRecord; every read checks them). The
-- txid range (every txid of the window is in it) lets the outbox's partitions outside it be skipped.
WITH page AS MATERIALIZED (
    SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic,
           shard, created_at, message_bytes, (message_bytes <= %(max_message_bytes)s) AS fits
    FROM outbox
    WHERE id > %(from_id)s AND id <= %(max_id)s
      AND txid >= %(prev_xmin)s::xid8 AND txid < %(cur_xmax)s::xid8
      AND state = 'logged'
      AND shard = ANY (%(shards)s::integer[])
      AND id > (%(last_ids)s::bigint[])[shard + 1]
      AND pg_visible_in_snapshot(txid, %(cur)s::pg_snapshot)
      AND NOT pg_visible_in_snapshot(txid, %(prev)s::pg_snapshot)
    ORDER BY id
    LIMIT %(limit)s
), budgeted AS (
    SELECT p.*,
           sum(CASE WHEN p.fits THEN p.message_bytes ELSE 0 END)
               OVER (ORDER BY p.id ROWS UNBOUNDED PRECEDING) AS running,
           count(*) OVER () AS claimed_rows
    FROM page AS p
)
SELECT id, event_id::text AS event_id,
       CASE WHEN fits THEN aggregate_type ELSE left(aggregate_type, 200) END AS aggregate_type,
       CASE WHEN fits THEN aggregate_id ELSE left(aggregate_id, 200) END AS aggregate_id,
       CASE WHEN fits THEN event_type ELSE left(event_type, 200) END AS event_type,
       CASE WHEN fits THEN payload::text END AS payload,
       CASE WHEN fits THEN payload_bytes END AS payload_bytes,
       CASE WHEN fits THEN nullif(headers, '{}'::jsonb) END AS headers,
       CASE WHEN fits THEN topic ELSE left(topic, 200) END AS topic,
       shard, extract(epoch FROM created_at)::float8 AS created_epoch, message_bytes AS size, claimed_rows
FROM budgeted
WHERE running - CASE WHEN fits THEN message_bytes ELSE 0 END < %(max_batch_bytes)s
ORDER BY id

-- name: log_advance
-- The batch's cursors, in its transaction, fenced like mark_batch on the shard leases.
UPDATE outbox_cursor AS c
SET tick = u.tick, window_to = u.window_to, last_id = u.last_id, max_id = u.max_id,
    updated_at = clock_timestamp()
FROM unnest(%(shards)s::integer[], %(ticks)s::bigint[], %(window_tos)s::bigint[], %(last_ids)s::bigint[],
            %(max_ids)s::bigint[]) AS u(shard, tick, window_to, last_id, max_id)
WHERE c.shard = u.shard
  AND c.shard IN (SELECT shard FROM outbox_shard_lease
                  WHERE owner = %(relay_id)s AND expires_at > clock_timestamp())
RETURNING c.shard

-- name: settle_cursors
-- Exactly-once: a batch's cursor moves, read back from its Kafka transaction after a crash between that
-- commit and the database's. A cursor moves only if it still stands where the batch found it: one the
-- batch's own commit moved, or that moved on since, stays. Fenced on the leases like log_advance.
UPDATE outbox_cursor AS c
SET tick = u.tick, window_to = u.window_to, last_id = u.last_id, max_id = u.max_id,
    updated_at = clock_timestamp()
FROM unnest(%(shards)s::integer[],
            %(from_ticks)s::bigint[], %(from_window_tos)s::bigint[], %(from_last_ids)s::bigint[],
            %(from_max_ids)s::bigint[],
            %(ticks)s::bigint[], %(window_tos)s::bigint[], %(last_ids)s::bigint[], %(max_ids)s::bigint[])
     AS u(shard, from_tick, from_window_to, from_last_id, from_max_id, tick, window_to, last_id, max_id)
WHERE c.shard = u.shard
  AND (c.tick, c.window_to, c.last_id, c.max_id)
      IS NOT DISTINCT FROM (u.from_tick, u.from_window_to, u.from_last_id, u.from_max_id)
  AND c.shard IN (SELECT shard FROM outbox_shard_lease
                  WHERE owner = %(relay_id)s AND expires_at > clock_timestamp())
RETURNING c.shard

-- name: outbox_identity
-- Exactly-once settlements name the outbox they settle (migration 0013's id) and its copy (the cursor
-- table's oid: a database restored elsewhere keeps the id, but its ticks and cursors may repeat).
SELECT (SELECT outbox_id::text FROM outbox_identity) || '/' || 'outbox_cursor'::regclass::oid::text

-- name: settle_leases_held
-- Whether this relay still leases every shard of the group whose settlement it writes: a write fenced
-- on a lease lost meanwhile changes nothing, which must not pass for "nothing to write". The leases are
-- locked until the write-back commits, so none changes hands before.
SELECT count(*) FROM (
    SELECT shard FROM outbox_shard_lease
    WHERE shard = ANY (%(shards)s::integer[]) AND owner = %(relay_id)s AND expires_at > clock_timestamp()
    FOR SHARE) AS held

-- name: settle_park
-- log_park for a settlement written back: only rows of the shards whose cursor it moved (the batch's
-- parks commit with its cursor moves; where the cursor was already moved, they are there already, and a
-- row requeued since must stay requeued).
UPDATE outbox AS t
SET state = 'failed', attempts = least(t.attempts, 2147483646) + 1, last_error = o.error, held_for = o.held_for
FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(held_for)s::text[]) AS o(id, error, held_for)
WHERE t.id = o.id AND t.state = 'logged' AND t.shard = ANY (%(shards)s::integer[])
  AND t.shard IN (SELECT shard FROM outbox_shard_lease
                  WHERE owner = %(relay_id)s AND expires_at > clock_timestamp())

-- name: settle_lock_timeout
-- A settlement is written while the group's last owner may still hold its rows (a zombie whose session
-- the lease tick is about to end): wait briefly, then try again at the next tick.
SELECT set_config('lock_timeout', '2s', true)

-- name: log_park
-- A row that can never be published leaves the log for the parked rows (state failed), where `postbox
-- relay status` shows it and `postbox relay requeue` puts it back (to pending: the relay claims those
-- first, in either mode). The one write to a row log mode makes, and only to a parked one.
-- A row held for a topic that cannot take messages (held_for) is put back by the relay once it can.
UPDATE outbox AS t
SET state = 'failed', attempts = least(t.attempts, 2147483646) + 1, last_error = o.error, held_for = o.held_for
FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(held_for)s::text[]) AS o(id, error, held_for)
WHERE t.id = o.id AND t.state = 'logged'
  AND t.shard IN (SELECT shard FROM outbox_shard_lease
                  WHERE owner = %(relay_id)s AND expires_at > clock_timestamp())

-- name: held_aggregates
-- The aggregates log mode holds (parked rows waiting for a topic), with the topic each waits for. Few:
-- read through outbox_failed_idx, at each lease renewal.
SELECT DISTINCT shard, aggregate_id, held_for FROM outbox WHERE state = 'failed' AND held_for IS NOT NULL

-- name: requeue_held
-- The rows held for a topic that takes messages again, back to the queue (claimed in id order, before
-- their shard's log): the row that met the blocked topic and the later rows of its aggregate together.
UPDATE outbox
SET state = 'pending', held_for = NULL, last_error = 'requeued after: ' || coalesce(last_error, '')
WHERE state = 'failed' AND held_for = %(topic)s
RETURNING id

-- name: log_prune_ticks
-- Ticks before the oldest cursor's are never read again.
DELETE FROM outbox_tick WHERE tick < (SELECT min(tick) FROM outbox_cursor)

-- name: log_cursor_lag
-- Log mode's progress per shard: how far (in tick time) each cursor is behind the newest tick.
SELECT c.shard, extract(epoch FROM (SELECT max(taken_at) FROM outbox_tick) - t.taken_at)::float8
FROM outbox_cursor AS c
JOIN outbox_tick AS t ON t.tick = c.tick
ORDER BY c.shard

-- name: log_ages
-- The newest tick's age, and the oldest open transaction with an id (any table, any database).
SELECT coalesce(extract(epoch FROM clock_timestamp() - (SELECT max(taken_at) FROM outbox_tick)), 0)::float8,
       coalesce((SELECT extract(epoch FROM clock_timestamp() - min(xact_start))
                 FROM pg_stat_activity WHERE backend_xid IS NOT NULL), 0)::float8

-- name: maintain_partitions
-- Partitions ahead of the txids in use (none created with a NULL width), finished ones marked done and,
-- with a retention, emptied whole and dropped (schemas/migrations/0007_outbox_partitions.sql).
SELECT created, done, emptied, dropped, parked_moved
FROM outbox_maintain_partitions(%(xids_per_partition)s::bigint, %(retention)s::interval)

-- name: log_switch_lock
-- Switching modes changes the state default: writers wait for this lock, so no row is written in the
-- old mode after the switch's tick, and none in the new mode before it. A running relay holds locks on
-- the outbox in every open batch, hence lock_timeout (set by the caller) and "stop the relays first".
LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE

-- name: log_record_switch
-- log_since: where the log began, set by the first switch to log mode (the stranded-rows check).
INSERT INTO outbox_mode (mode, tick, log_since)
SELECT %(mode)s, %(tick)s, CASE WHEN %(mode)s = 'log' THEN pg_snapshot_xmin(t.snapshot) END
FROM outbox_tick AS t WHERE t.tick = %(tick)s
ON CONFLICT (singleton) DO UPDATE SET mode = excluded.mode, tick = excluded.tick, switched_at = clock_timestamp(),
                                      log_since = coalesce(outbox_mode.log_since, excluded.log_since)

-- name: guard_writes
-- The insert guard of migration 0009 for the state rows are now written in (in the switch's transaction).
SELECT outbox_guard_writes(%(state)s)

-- name: log_switch_to_log
ALTER TABLE outbox ALTER COLUMN state SET DEFAULT 'logged'

-- name: log_switch_to_queue
ALTER TABLE outbox ALTER COLUMN state SET DEFAULT 'pending'

-- name: log_unread_to_queue
-- A switch to log mode starts every cursor at its own tick. Logged rows no cursor had reached by then
-- (written before a switch to queue mode, in a log no relay went on to read) would lie behind every
-- cursor and never be read: they go to the queue, where a relay in log mode claims a shard's pending rows,
-- in id order, before it reads the shard's log. Rows of a window being read count as unread (sent again at
-- worst, with the same event id). Reads outbox_log_idx from the oldest cursor's snapshot on only.
UPDATE outbox AS o SET state = 'pending'
FROM outbox_cursor AS c
LEFT JOIN outbox_tick AS t ON t.tick = c.tick
WHERE o.state = 'logged' AND o.shard = c.shard
  AND o.txid >= coalesce((SELECT min(pg_snapshot_xmin(t2.snapshot))
                          FROM outbox_cursor AS c2 JOIN outbox_tick AS t2 ON t2.tick = c2.tick), '0'::xid8)
  AND (t.snapshot IS NULL OR NOT pg_visible_in_snapshot(o.txid, t.snapshot))

-- name: log_start_cursors
-- Every cursor starts at the switch's tick: rows written from then on are logged; rows pending from
-- before stay pending, and a relay in log mode claims those first.
UPDATE outbox_cursor SET tick = %(tick)s, window_to = NULL, last_id = NULL, max_id = NULL,
                         updated_at = clock_timestamp()

-- name: log_started
SELECT EXISTS (SELECT FROM outbox_mode)

-- name: log_behind_switch
-- After a switch back to queue mode: the shards whose log is not yet read to the switch's tick.
SELECT count(*) FROM outbox_cursor AS c, outbox_mode AS m WHERE m.mode = 'queue' AND c.tick < m.tick

-- name: log_backlog
-- Logged rows still to publish (those of a window being read count until it is finished), and the oldest
-- one's age. Walks outbox_log_idx from the oldest cursor's snapshot on, not the whole log.
SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(o.created_at)), 0)::float8
FROM outbox AS o
JOIN outbox_cursor AS c ON c.shard = o.shard
JOIN outbox_tick AS t ON t.tick = c.tick
WHERE o.state = 'logged'
  AND o.txid >= (SELECT min(pg_snapshot_xmin(t2.snapshot))
                 FROM outbox_cursor AS c2 JOIN outbox_tick AS t2 ON t2.tick = c2.tick)
  AND NOT pg_visible_in_snapshot(o.txid, t.snapshot)
  -- Stranded rows (which no cursor will reach) are counted on their own (stranded_rows).
  AND o.id NOT IN (SELECT s.id FROM outbox_stranded AS s)

-- name: stranded_rows
-- Committed rows that no relay will ever read (migration 0009's outbox_stranded view says which): their
-- count and the lowest ids, for `postbox relay status`.
SELECT count(*), coalesce((SELECT array_agg(id) FROM (SELECT id FROM outbox_stranded ORDER BY id
                                                      LIMIT %(show)s) AS s), '{}')
FROM outbox_stranded

-- name: requeue_stranded
-- The stranded rows to the queue, which relays claim in either mode.
UPDATE outbox AS o
SET state = 'pending', last_error = 'requeued: stranded (logged where no relay reads the log)'
FROM outbox_stranded AS s
WHERE o.id = s.id AND o.state = 'logged'
RETURNING o.id

-- name: foreign_ticks
-- A tick taken at a transaction counter this cluster has not reached: the outbox was restored (or
-- replicated) from another cluster. Its snapshots mean nothing here: a row written now has a txid that
-- the old snapshots take for long committed, so no window would ever hold it. Returns the newest tick's
-- counter and this cluster's; no row when the log belongs here.
-- Only the newest tick is read: ticks are taken in order, so it is the furthest ahead.
SELECT t.tick, pg_snapshot_xmax(t.snapshot)::text, pg_snapshot_xmax(pg_current_snapshot())::text
FROM (SELECT tick, snapshot FROM outbox_tick ORDER BY tick DESC LIMIT 1) AS t
WHERE pg_snapshot_xmax(t.snapshot) > pg_snapshot_xmax(pg_current_snapshot())

-- name: rebase_unread_to_queue
-- `postbox relay rebase`: every logged row leaves the log, to the queue (pending: claimed before any
-- shard's log is read, in id order) unless it is known to be published. Known only for a row whose txid
-- is ahead of this cluster's counter: it was written on the old cluster, and its shard's old cursor
-- snapshot (the old cluster's own, judging the old cluster's own txid) says whether it was read. A row
-- below the counter may have been written here after the move (the old snapshots would take it for read
-- long ago) or on the old cluster: it is queued, so it is published once more at worst. Rows of a window
-- being read count as unread: sent again (duplicates with the same event id), never lost.
UPDATE outbox AS o
SET state = CASE WHEN o.txid >= pg_snapshot_xmax(pg_current_snapshot())
                      AND pg_visible_in_snapshot(o.txid, t.snapshot) THEN 'published' ELSE 'pending' END,
    published_at = CASE WHEN o.txid >= pg_snapshot_xmax(pg_current_snapshot())
                             AND pg_visible_in_snapshot(o.txid, t.snapshot) THEN clock_timestamp() END
FROM outbox_cursor AS c
LEFT JOIN outbox_tick AS t ON t.tick = c.tick
WHERE o.state = 'logged' AND o.shard = c.shard
RETURNING o.state

-- name: rebase_forget_ticks
DELETE FROM outbox_tick

-- name: rebase_cursors
UPDATE outbox_cursor SET tick = %(tick)s, window_to = NULL, last_id = NULL, max_id = NULL,
                         updated_at = clock_timestamp()

-- name: rebase_mode
-- The switch's tick and the log's beginning, as if the outbox had been switched now on this cluster.
UPDATE outbox_mode AS m
SET tick = %(tick)s,
    log_since = CASE WHEN m.log_since IS NOT NULL OR m.mode = 'log' THEN pg_snapshot_xmin(t.snapshot) END
FROM outbox_tick AS t
WHERE t.tick = %(tick)s
