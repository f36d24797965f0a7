-- The columns a relay reads rows by are the database's to set, and the database enforces it.
--
-- Log mode reads a row in the window of the transaction that wrote it (txid), and each mode reads only
-- rows in its own state ('logged' in log mode, 'pending' in queue mode). A writer's role that may insert
-- into the outbox (most services migrate and write with one role, the table owner, which no GRANT can
-- restrict) could set either column, and such a row was committed and never published: a txid of an
-- earlier transaction lies in a window every cursor has passed, a txid ahead of the counter in none yet,
-- and a state of 'published' (or 'logged' in queue mode) is read by nobody.
--
-- So an INSERT that sets txid to anything but its own transaction's id, or state to anything but the
-- outbox mode's, is refused with an error naming the column (SQLSTATE 428C9, as for a generated column).
-- The check is a trigger's WHEN condition, evaluated without calling a function: a row that leaves both
-- columns to their defaults costs two comparisons. The function below runs only for a row the condition
-- catches, and only to raise the error (or to let maintenance's own move of a parked row through).
-- `postbox relay switch-mode` re-creates the insert guard with the new mode's state, in the transaction
-- that changes the state's default (outbox_guard_writes below).
--
-- Updates that would strand a row are refused the same way: a txid changed (except maintenance's move
-- of a parked row to outbox_parked, txid 0), a row made 'logged', or a logged row made anything but
-- parked ('failed', the relay's own log_park). The relay's marks (pending to published, failed or
-- pending), its parking and `postbox relay requeue` (failed to pending) pass the condition unnoticed.
--
-- What a role can still do on purpose (disable the triggers, update a pending row to 'published' as the
-- relay does) is outside these checks; the relay's stranded-rows check (postbox relay status, the
-- postbox_relay_stranded_rows gauge) finds any committed row no cursor will reach, however it got there.

CREATE FUNCTION outbox_refuse_write() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    mode_state constant text := TG_ARGV[0];  -- the insert guard's: the state rows are written in
BEGIN
    -- Maintenance moves a parked row out of a partition it empties (txid 0: outbox_maintain_partitions);
    -- a row parked there is shown by `postbox relay status` and put back by requeue, wherever it came from.
    IF NEW.txid = '0'::xid8 AND NEW.state = 'failed' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- `postbox relay rebase` (a moved database) hands the unread rows of the old cluster's log to the
        -- queue, as one transaction that holds the outbox locked.
        IF current_setting('postbox.rebase', true) = 'on' THEN
            RETURN NEW;
        END IF;
        IF NEW.txid <> OLD.txid THEN
            RAISE EXCEPTION 'outbox.txid is set by the database and never changes (row %)', OLD.id
                USING ERRCODE = '428C9', COLUMN = 'txid', TABLE = 'outbox', SCHEMA = TG_TABLE_SCHEMA,
                      HINT = 'log mode reads a row in the window of the transaction that wrote it';
        END IF;
        RAISE EXCEPTION 'outbox.state: a row may not go from % to % (row %)', OLD.state, NEW.state, OLD.id
            USING ERRCODE = '428C9', COLUMN = 'state', TABLE = 'outbox', SCHEMA = TG_TABLE_SCHEMA,
                  HINT = 'the relay sets the state; `postbox relay requeue` puts parked rows back';
    END IF;
    IF NEW.txid <> pg_current_xact_id() THEN
        RAISE EXCEPTION 'outbox.txid is set by the database: leave it out of the INSERT'
            USING ERRCODE = '428C9', COLUMN = 'txid', TABLE = 'outbox', SCHEMA = TG_TABLE_SCHEMA,
                  HINT = 'log mode reads a row in the window of the transaction that wrote it';
    END IF;
    RAISE EXCEPTION 'outbox.state is set by the database: leave it out of the INSERT (this outbox writes %, not %)',
        mode_state, NEW.state
        USING ERRCODE = '428C9', COLUMN = 'state', TABLE = 'outbox', SCHEMA = TG_TABLE_SCHEMA,
              HINT = 'the relay publishes only rows in the state of the outbox''s mode';
END;
$$;

-- (Re)creates the insert guard for the state new rows take (its WHEN condition names it, so it costs no
-- lookup per row). Called by this migration and by `postbox relay switch-mode`, in the transaction that
-- changes outbox.state's default; teams that switch modes with their own tool call it the same way.
CREATE FUNCTION outbox_guard_writes(mode_state text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF mode_state NOT IN ('pending', 'logged') THEN
        RAISE EXCEPTION 'outbox_guard_writes: mode_state must be pending or logged, not %', mode_state;
    END IF;
    DROP TRIGGER IF EXISTS outbox_guard_insert ON outbox;
    EXECUTE format('CREATE TRIGGER outbox_guard_insert BEFORE INSERT ON outbox FOR EACH ROW '
                   'WHEN (NEW.state <> %1$L OR NEW.txid <> pg_current_xact_id()) '
                   'EXECUTE FUNCTION outbox_refuse_write(%1$L)', mode_state);
END;
$$;

SELECT outbox_guard_writes(CASE WHEN (SELECT mode FROM outbox_mode) = 'log' THEN 'logged' ELSE 'pending' END);

CREATE TRIGGER outbox_guard_update BEFORE UPDATE OF txid, state ON outbox FOR EACH ROW
    WHEN (NEW.txid <> OLD.txid
          OR (NEW.state = 'logged' AND OLD.state <> 'logged')
          OR (OLD.state = 'logged' AND NEW.state NOT IN ('logged', 'failed')))
    EXECUTE FUNCTION outbox_refuse_write('');

-- Where the log began: the xmin of the first switch to log mode's snapshot. A logged row with an older
-- txid was committed before any relay read the log, so none ever will (the stranded-rows check). NULL on
-- an outbox switched before this migration: there, only txid 0 counts as before the log.
ALTER TABLE outbox_mode ADD COLUMN log_since xid8;

-- Committed rows that no relay will ever read, however they got there (the guards above refuse the
-- ordinary ways; a moved database, a disabled trigger or a superuser's write remain): logged rows whose
-- txid is ahead of this cluster's transaction counter (no window holds them until it gets there; a
-- database restored from a cluster with a higher counter), before the log began (log_since, or txid 0),
-- or written where no relay reads the log (never switched to log mode, or after the switch back to queue
-- mode). Each branch is a range or a small set of outbox_log_idx (txid, id): on a healthy outbox it reads
-- no row at all, however large. `postbox relay status` names them, the relay counts them
-- (postbox_relay_stranded_rows) and `postbox relay requeue --stranded` puts them in the queue.
CREATE VIEW outbox_stranded AS
WITH m AS (
    SELECT m.mode, m.log_since, t.snapshot AS switched
    FROM outbox_mode AS m LEFT JOIN outbox_tick AS t ON t.tick = m.tick
)
SELECT id FROM outbox
WHERE state = 'logged' AND txid >= pg_snapshot_xmax(pg_current_snapshot())
UNION
SELECT id FROM outbox
WHERE state = 'logged' AND txid < coalesce((SELECT log_since FROM m), '1'::xid8)
UNION
SELECT id FROM outbox
WHERE state = 'logged' AND NOT EXISTS (SELECT FROM m)
UNION
SELECT id FROM outbox
WHERE state = 'logged' AND (SELECT mode FROM m) = 'queue'
  AND txid >= (SELECT pg_snapshot_xmin(switched) FROM m)  -- an index condition: the rows from there on
  AND NOT pg_visible_in_snapshot(txid, (SELECT switched FROM m));

-- Log mode holds only the aggregates whose events go to a topic that cannot take them (unknown, not
-- authorised): such a row, and every later row of its aggregate, is parked with the topic it waits for
-- here, and the rest of its shard flows. The relay puts them back in the queue, in id order, once the topic
-- takes messages (`postbox relay requeue` too). NULL for every other row.
ALTER TABLE outbox ADD COLUMN held_for text;
