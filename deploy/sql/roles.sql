-- Least-privilege roles for postbox. Run as the owner of the postbox schema, after `postbox migrate`.
-- psql -v schema=postbox -v relay_password="'...'" -f deploy/sql/roles.sql
\set ON_ERROR_STOP on

-- The relay: reads and marks outbox rows, keeps its shard leases and membership; nothing else. It may
-- end sessions of its own role (how a replica that takes over fences a paused one), which needs no grant.
CREATE ROLE postbox_relay LOGIN PASSWORD :relay_password;
GRANT USAGE ON SCHEMA :"schema" TO postbox_relay;
GRANT SELECT, UPDATE ON :"schema".outbox TO postbox_relay;
GRANT SELECT, UPDATE ON :"schema".outbox_shard_lease TO postbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".outbox_relay_member TO postbox_relay;

-- Pruning published rows (`postbox relay prune`, or --prune-retention or --delete-on-publish in the daemon)
-- also needs DELETE;
-- grant it to a separate maintenance role, or to postbox_relay if the daemon prunes:
--   GRANT DELETE ON :"schema".outbox TO postbox_relay;

-- An application that writes events: insert only, and only the columns `enqueue` writes. The relay's own
-- columns (state, attempts, created_at, published_at, last_error) keep their defaults, so no writer can
-- insert a row already "published", with an attempt count that overflows the mark, or with a forged age.
CREATE ROLE postbox_writer NOLOGIN;
GRANT USAGE ON SCHEMA :"schema" TO postbox_writer;
GRANT INSERT (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, topic)
    ON :"schema".outbox TO postbox_writer;
-- e.g.  GRANT postbox_writer TO orders_service;
