-- Least-privilege roles for postbox: one per workload, each allowed only its own job.
-- Run after `postbox migrate`, as a role that may create roles and owns the schema (or a superuser):
--   psql "$ADMIN_URL" -v schema=postbox \
--        -v migrator_password="'...'" -v relay_password="'...'" -v inbox_password="'...'" \
--        -v receiver_password="'...'" -v worker_password="'...'" -f deploy/sql/roles.sql
-- Safe to run again (after a migration adds a table): a role that exists is kept, grants are repeated.
\set ON_ERROR_STOP on

SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', name, password)
FROM (VALUES ('postbox_migrator', :'migrator_password'), ('postbox_relay', :'relay_password'),
             ('postbox_inbox', :'inbox_password'), ('postbox_webhook_receiver', :'receiver_password'),
             ('postbox_webhook_worker', :'worker_password')) AS r(name, password)
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r.name)
\gexec
SELECT 'CREATE ROLE postbox_writer NOLOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'postbox_writer')
\gexec

-- The migrator (the migrate Job): owns the schema and everything in it, so later migrations apply, and
-- may create schemas in this database (`postbox migrate` runs CREATE SCHEMA IF NOT EXISTS). No daemon
-- runs as it; retention commands (`postbox relay prune`, `inbox prune`, `inbox prune-webhooks`) may.
SELECT format('GRANT CREATE ON DATABASE %I TO postbox_migrator', current_database())
\gexec
ALTER SCHEMA :"schema" OWNER TO postbox_migrator;
SELECT format('ALTER TABLE %I.%I OWNER TO postbox_migrator', schemaname, tablename)
FROM pg_tables WHERE schemaname = :'schema'
\gexec
SELECT format('ALTER VIEW %I.%I OWNER TO postbox_migrator', schemaname, viewname)
FROM pg_views WHERE schemaname = :'schema'
\gexec
SELECT format('ALTER FUNCTION %s OWNER TO postbox_migrator', p.oid::regprocedure)
FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = :'schema'
\gexec

GRANT USAGE ON SCHEMA :"schema"
    TO postbox_relay, postbox_writer, postbox_inbox, postbox_webhook_receiver, postbox_webhook_worker;

-- An application that writes events: insert only, and only the columns `enqueue` writes. The relay's own
-- columns (state, attempts, created_at, published_at, last_error) keep their defaults, so no writer can
-- insert a row already "published", with an attempt count that overflows the mark, or with a forged age.
-- The SQL writers postbox.enqueue() and enqueue_bytes() (migration 0010) and enqueue_many() (0011) run
-- with these same rights (SECURITY INVOKER); EXECUTE on them is granted here, not left to PUBLIC's default.
-- e.g.  GRANT postbox_writer TO orders_service;
GRANT INSERT (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic)
    ON :"schema".outbox TO postbox_writer;
GRANT EXECUTE ON FUNCTION :"schema".enqueue(text, text, text, jsonb, jsonb, text),
    :"schema".enqueue_bytes(text, text, text, bytea, jsonb, text),
    :"schema".enqueue_many(text[], text[], text[], jsonb[], jsonb[], text[]) TO postbox_writer;

-- The relay: reads and marks outbox rows, keeps its shard leases and membership; nothing else. It may
-- end sessions of its own role (how a replica that takes over fences a paused one), which needs no grant.
GRANT SELECT, UPDATE (state, published_at, attempts, last_error, held_for) ON :"schema".outbox TO postbox_relay;
GRANT SELECT, UPDATE ON :"schema".outbox_shard_lease TO postbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_relay_member TO postbox_relay;
-- Log mode: takes ticks (and deletes those every cursor has passed) and moves its cursors.
GRANT SELECT, INSERT, DELETE ON :"schema".outbox_tick TO postbox_relay;
GRANT SELECT, UPDATE ON :"schema".outbox_cursor TO postbox_relay;
GRANT SELECT ON :"schema".outbox_mode TO postbox_relay;
GRANT SELECT ON :"schema".outbox_identity TO postbox_relay;  -- --exactly-once names its topic after it
-- The stranded-rows check (migration 0009): committed rows no cursor will reach.
GRANT SELECT ON :"schema".outbox_stranded TO postbox_relay;
-- The outbox's partitions (migration 0007): created ahead, emptied and dropped by a function that runs
-- as its owner (the migrator), so the relay needs no ownership, DDL right or TRUNCATE of its own.
GRANT EXECUTE ON FUNCTION :"schema".outbox_maintain_partitions(bigint, interval) TO postbox_relay;
GRANT SELECT ON :"schema".outbox_partition TO postbox_relay;  -- for `postbox relay status`
-- Pruning published rows (--prune-retention or --delete-on-publish in the daemon) also needs DELETE;
-- `postbox relay prune` can run as the migrator instead:
--   GRANT DELETE ON :"schema".outbox TO postbox_relay;

-- The inbox consumer: claims and parks messages. Grant it your handlers' own tables too
-- (GRANT SELECT, INSERT, UPDATE ON orders_projection TO postbox_inbox), or make it a member of a role
-- that has them. Retention (`postbox inbox prune`) runs as the migrator.
GRANT SELECT, INSERT, UPDATE (status, error, attempts) ON :"schema".inbox_message TO postbox_inbox;

-- The webhook receiver (and `postbox inbox reconcile`): stores verified events, reads nothing back but
-- the keys its insert returns (provider and id: one statement stores the events of several requests).
GRANT INSERT (provider, event_id, event_type, payload, headers, twin_key) ON :"schema".webhook_inbox
    TO postbox_webhook_receiver;
GRANT SELECT (provider, event_id) ON :"schema".webhook_inbox TO postbox_webhook_receiver;

-- The webhook worker: claims, finishes and reaps events. Grant it your handlers' tables as above.
GRANT SELECT, UPDATE (status, attempts, last_error, not_before, locked_at, processed_at)
    ON :"schema".webhook_inbox TO postbox_webhook_worker;
