-- The outbox partitioned by the writing transaction's id (txid), so retention empties whole partitions
-- (TRUNCATE: no per-row delete, no dead rows, no vacuum debt) instead of deleting row by row. Writers do
-- not change: they insert into outbox as before and PostgreSQL routes each row to its partition.
--
-- Why by txid and not by id or time: log mode reads rows by the snapshot their transaction committed in.
-- A partition holding the txids [from, to) is complete once every transaction below `to` has ended
-- (pg_snapshot_xmin of a snapshot >= to): no row can ever be added to it again. "Every shard's cursor has
-- passed it" is then a visibility check of its logged rows against the oldest cursor tick's snapshot,
-- with no gap or late-commit reasoning (an id range cannot say that: an id is taken before its
-- transaction commits, and may commit minutes later).
--
-- outbox_maintain_partitions() (below) creates partitions ahead of the txids in use and empties and drops
-- finished ones; relays call it (SECURITY DEFINER: the relay's role needs EXECUTE on it, not ownership of
-- the outbox). A default partition takes rows whose txid has no partition yet (no relay ran for a long
-- time), so a writer never fails for want of one.
--
-- On an existing outbox this migration holds an exclusive lock on it while it reads every row once (the
-- check that they fit the first partition): no rewrite, no index build. The existing table becomes that
-- first partition, outbox_p0, with its primary key, indexes and rows; grants on the outbox are copied to
-- the new parent, column grants included.

DO $migrate$
DECLARE
    next_id bigint;
    boundary bigint;
    grant_row record;
BEGIN
    LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;
    -- Every row now in the outbox has a txid below the next one to be assigned.
    boundary := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    EXECUTE format('SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM %s',
                   pg_get_serial_sequence('outbox', 'id')) INTO next_id;

    ALTER TABLE outbox RENAME TO outbox_p0;
    ALTER INDEX outbox_pkey RENAME TO outbox_p0_pkey;
    ALTER INDEX outbox_pending_idx RENAME TO outbox_p0_pending_idx;
    ALTER INDEX outbox_failed_idx RENAME TO outbox_p0_failed_idx;
    ALTER INDEX outbox_log_idx RENAME TO outbox_p0_log_idx;
    DROP TRIGGER outbox_notify ON outbox_p0;
    -- A partition cannot have an identity of its own; the parent's continues the same ids.
    ALTER TABLE outbox_p0 ALTER COLUMN id DROP IDENTITY;

    -- Same columns, defaults (the state default says the mode), generated columns, checks.
    CREATE TABLE outbox (LIKE outbox_p0 INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED)
        PARTITION BY RANGE (txid);
    EXECUTE format('ALTER TABLE outbox ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH %s)',
                   next_id);
    -- Partitioned indexes: outbox_p0's own match them and are attached as they are. A primary key on the
    -- parent would have to include txid; each partition has PRIMARY KEY (id) instead, and ids are unique
    -- across partitions because writers cannot set them (GENERATED ALWAYS).
    CREATE INDEX outbox_pending_idx ON outbox (id, shard) WHERE state = 'pending';
    CREATE INDEX outbox_failed_idx ON outbox (id) WHERE state = 'failed';
    CREATE INDEX outbox_log_idx ON outbox (txid) WHERE state = 'logged';
    EXECUTE format('ALTER TABLE outbox ATTACH PARTITION outbox_p0 FOR VALUES FROM (''1'') TO (%L)', boundary);
    -- Parked rows (state failed) of a partition about to be emptied move here, with txid 0 ("no
    -- transaction"): maintenance never empties it, so status and requeue still find them. A requeued row
    -- is pending here, published from here, and deleted by the per-row prune once published.
    CREATE TABLE outbox_parked (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED);
    ALTER TABLE outbox_parked ADD CONSTRAINT outbox_parked_pkey PRIMARY KEY (id);
    ALTER TABLE outbox ATTACH PARTITION outbox_parked FOR VALUES FROM (MINVALUE) TO ('1');
    CREATE TABLE outbox_default (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED);
    ALTER TABLE outbox_default ADD CONSTRAINT outbox_default_pkey PRIMARY KEY (id);
    ALTER TABLE outbox ATTACH PARTITION outbox_default DEFAULT;
    CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

    -- The grants on the outbox (writers' column grants, the relay's) carry over to the parent, which is
    -- what is checked on every read and write through it.
    FOR grant_row IN
        SELECT a.grantee::regrole::text AS grantee, a.privilege_type AS privilege, NULL::name AS column_name
        FROM pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = 'outbox_p0'::regclass AND a.grantee <> c.relowner AND a.grantee <> 0
        UNION ALL
        SELECT a.grantee::regrole::text, a.privilege_type, t.attname
        FROM pg_attribute AS t, aclexplode(t.attacl) AS a
        WHERE t.attrelid = 'outbox_p0'::regclass AND t.attacl IS NOT NULL AND a.grantee <> 0
    LOOP
        IF grant_row.column_name IS NULL THEN
            EXECUTE format('GRANT %s ON outbox TO %s', grant_row.privilege, grant_row.grantee);
        ELSE
            EXECUTE format('GRANT %s (%I) ON outbox TO %s', grant_row.privilege, grant_row.column_name,
                           grant_row.grantee);
        END IF;
    END LOOP;

    CREATE TABLE outbox_partition (
        name       text PRIMARY KEY,
        xid_from   bigint,               -- txids from (NULL: from the first, outbox_p0) ...
        xid_to     bigint,               -- ... to, excluded (NULL: the default partition)
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        done_at    timestamptz,          -- when every row in it was found published or read
        emptied_at timestamptz           -- truncated, to be dropped
    );
    INSERT INTO outbox_partition (name, xid_from, xid_to) VALUES ('outbox_p0', NULL, boundary),
                                                               ('outbox_default', NULL, NULL);
END
$migrate$;

COMMENT ON TABLE outbox_partition IS
    'postbox: the outbox''s partitions by txid, kept by outbox_maintain_partitions()';

-- Creates partitions ahead of the txids in use (up to two widths ahead), marks finished ones done, and,
-- with a retention, empties the partitions done for longer than it and then drops the emptied ones.
-- Returns what it did, as counts. One caller at a time (a transaction-scoped advisory lock; others return
-- at once). Locks are taken with a short lock_timeout; a partition that cannot be locked is left for the
-- next call. What "finished" means, for a partition of txids [from, to):
--   * every transaction with a txid below `to` has ended (so no row can be added to it);
--   * it holds no pending row (queue mode's, or a requeued one, still to publish);
--   * every logged row in it is visible in the snapshot of the oldest tick a cursor stands at (so every
--     shard has read it; the log index finds the rows from that snapshot's xmin on).
-- Parked rows (state failed) are moved to outbox_parked (txid 0, same id, reason and attempts) just
-- before a partition is emptied, so `postbox relay status` and requeue still see them.
-- The default partition is emptied under its lock when every row in it is finished by the same rules
-- and older than the retention.
CREATE FUNCTION outbox_maintain_partitions(xids_per_partition bigint, retention interval DEFAULT NULL)
    RETURNS TABLE (created integer, done integer, emptied integer, dropped integer, parked_moved integer)
    LANGUAGE plpgsql SECURITY DEFINER
    SET lock_timeout = '200ms'
AS $maintain$
DECLARE
    -- txids as bigint (xid8 has no arithmetic): 64-bit, epoch included, never wrapping.
    next_xid bigint := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    oldest_running bigint := pg_snapshot_xmin(pg_current_snapshot())::text::bigint;
    top bigint;
    part record;
    moved integer;
    blocked boolean;
    read_snapshot pg_snapshot;
    read_xmin xid8;
    -- A partition (%1$I) holds a row still to publish: pending, or logged and not visible in the snapshot
    -- read_snapshot ($2, with its xmin $1; the log index finds the logged rows from there).
    unfinished constant text := 'SELECT EXISTS (SELECT FROM %1$I WHERE state = ''pending'') '
        'OR EXISTS (SELECT FROM %1$I WHERE state = ''logged'' AND (txid >= $1 OR $1 IS NULL) '
        'AND NOT coalesce(pg_visible_in_snapshot(txid, $2), false))';
    -- The default partition, besides: a row not past the retention ($3), or no row at all.
    default_blocked constant text := format(unfinished, 'outbox_default')
        || ' OR EXISTS (SELECT FROM outbox_default WHERE coalesce(published_at, created_at) >= '
        'clock_timestamp() - $3) OR NOT EXISTS (SELECT FROM outbox_default)';
BEGIN
    created := 0; done := 0; emptied := 0; dropped := 0; parked_moved := 0;
    IF xids_per_partition < 1 THEN
        RAISE EXCEPTION 'outbox_maintain_partitions: xids_per_partition must be at least 1, not %',
            xids_per_partition;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('postbox.partitions.' || current_schema(), 0)) THEN
        RETURN NEXT;
        RETURN;
    END IF;

    -- Ahead: partitions for the txids to come, up to two widths past the next txid. ATTACH alone takes only
    -- SHARE UPDATE EXCLUSIVE on the outbox, and a writer whose INSERT began before it commits routes its
    -- row with the partitions it saw then: a txid of the new range would send the row to the default
    -- partition, whose constraint now refuses it, and the writer would fail. So inserts are held off
    -- (SHARE: readers, claims and marks go on) while partitions are attached, and the next txid is read
    -- again once they are: every txid from there on has written nothing yet, so the new partitions start
    -- at it at the earliest (after a long pause, the txids in between stay in the default partition).
    -- Writers queue behind the lock while it waits, so it waits at most 50 ms; the partitions are due a
    -- width of txids before they are needed, so there are many more tries.
    SELECT max(p.xid_to) INTO top FROM outbox_partition AS p WHERE p.xid_to IS NOT NULL;
    IF top IS NULL OR top < next_xid + 2 * xids_per_partition THEN
        BEGIN
            PERFORM set_config('lock_timeout', '50ms', true);
            LOCK TABLE outbox IN SHARE MODE;
            PERFORM set_config('lock_timeout', '200ms', true);
            next_xid := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
            IF top IS NULL OR top < next_xid THEN
                top := next_xid;
            END IF;
            WHILE top < next_xid + 2 * xids_per_partition LOOP
                EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                               'INCLUDING GENERATED)', 'outbox_x' || top);
                EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I PRIMARY KEY (id)', 'outbox_x' || top,
                               'outbox_x' || top || '_pkey');
                EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                               'outbox_x' || top, top, top + xids_per_partition);
                INSERT INTO outbox_partition (name, xid_from, xid_to)
                VALUES ('outbox_x' || top, top, top + xids_per_partition);
                created := created + 1;
                top := top + xids_per_partition;
            END LOOP;
        EXCEPTION WHEN lock_not_available THEN
            created := 0;  -- open writes held the lock past the timeout: next call
        END;
        PERFORM set_config('lock_timeout', '200ms', true);
    END IF;

    -- How far every shard's log is read: the snapshot of the oldest tick a cursor stands at (every row
    -- visible in it is published). NULL while a shard has no cursor (before the first switch to log mode).
    SELECT t.snapshot INTO read_snapshot
    FROM outbox_tick AS t
    WHERE t.tick = (SELECT min(c.tick) FROM outbox_cursor AS c)
      AND NOT EXISTS (SELECT FROM outbox_cursor AS c WHERE c.tick IS NULL);
    read_xmin := pg_snapshot_xmin(read_snapshot);

    -- Each partition no transaction can write to any more, checked on its own: a row stuck pending (a
    -- blocked topic) holds back its partition, not the later ones.
    FOR part IN
        SELECT p.name FROM outbox_partition AS p
        WHERE p.done_at IS NULL AND p.xid_to IS NOT NULL AND p.xid_to <= oldest_running
        ORDER BY p.xid_to
    LOOP
        EXECUTE format(unfinished, part.name) USING read_xmin, read_snapshot INTO blocked;
        CONTINUE WHEN blocked;
        UPDATE outbox_partition SET done_at = clock_timestamp() WHERE name = part.name;
        done := done + 1;
    END LOOP;

    IF retention IS NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;

    FOR part IN
        SELECT p.name, p.xid_to FROM outbox_partition AS p
        WHERE p.emptied_at IS NULL
          AND (p.done_at < clock_timestamp() - retention OR p.xid_to IS NULL)
        ORDER BY p.xid_to NULLS LAST
    LOOP
        IF part.xid_to IS NULL THEN
            -- The default partition is looked at without its lock first: it is usually empty, and the
            -- lock would stop every reader and writer of the outbox for a moment.
            EXECUTE default_blocked USING read_xmin, read_snapshot, retention INTO blocked;
            CONTINUE WHEN blocked;
        END IF;
        BEGIN
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part.name);
            IF part.xid_to IS NULL THEN
                -- With its lock held every row in it is committed: empty it only if all are finished and
                -- past the retention (it is never dropped).
                EXECUTE default_blocked USING read_xmin, read_snapshot, retention INTO blocked;
            ELSE
                -- The done check again, under the lock: a requeue may have made a parked row of a done
                -- partition pending again.
                EXECUTE format(unfinished, part.name) USING read_xmin, read_snapshot INTO blocked;
                IF blocked THEN
                    UPDATE outbox_partition SET done_at = NULL WHERE name = part.name;
                END IF;
            END IF;
            IF NOT blocked THEN
                -- Through the parent, so the row moves to outbox_parked (same id, reason and attempts).
                UPDATE outbox SET txid = '0' WHERE state = 'failed' AND tableoid = part.name::regclass;
                GET DIAGNOSTICS moved = ROW_COUNT;
                parked_moved := parked_moved + moved;
                EXECUTE format('TRUNCATE %I', part.name);
                UPDATE outbox_partition SET emptied_at = clock_timestamp()
                WHERE name = part.name AND xid_to IS NOT NULL;
                emptied := emptied + 1;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- in use (a reader's lock): next call
        END;
    END LOOP;

    -- Dropping a partition locks the whole outbox (writers wait), so each try waits at most 50 ms; an
    -- emptied partition that stays is an empty table, no cost but a catalog entry.
    FOR part IN SELECT p.name FROM outbox_partition AS p WHERE p.emptied_at IS NOT NULL ORDER BY p.xid_to LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '50ms', true);
            EXECUTE format('DROP TABLE %I', part.name);
            DELETE FROM outbox_partition WHERE name = part.name;
            dropped := dropped + 1;
        EXCEPTION WHEN lock_not_available THEN
            EXIT;
        END;
    END LOOP;
    RETURN NEXT;
END
$maintain$;

-- SECURITY DEFINER runs as the function's owner: fix its search_path to this schema, and let only the
-- roles granted EXECUTE call it (deploy/sql/roles.sql grants the relay).
DO $fix$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_maintain_partitions(bigint, interval) SET search_path = %I, pg_temp',
                   current_schema());
END
$fix$;
REVOKE EXECUTE ON FUNCTION outbox_maintain_partitions(bigint, interval) FROM PUBLIC;

-- No partition ahead yet: the first relay to start creates them with its --partition-xids. Rows written
-- until then go to the default partition, and are read and emptied like any other.
