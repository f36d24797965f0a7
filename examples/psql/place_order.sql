-- Places an order and writes its OrderChanged event in one transaction, through the SQL functions
-- `postbox migrate` installs: what a service in any language does with its own PostgreSQL driver.
--
--   psql "$DATABASE_URL" -v schema="${POSTBOX_SCHEMA:-postbox}" -v total=9.99 -f examples/psql/place_order.sql
--
-- :schema is the outbox's schema, :total the order's total. The `orders` table is created when missing.
\set ON_ERROR_STOP on
\set QUIET on
SET client_min_messages TO warning;  -- no NOTICE when the table exists

CREATE TABLE IF NOT EXISTS orders (
    id      text PRIMARY KEY,
    total   numeric(12, 2) NOT NULL CONSTRAINT orders_total_check CHECK (total >= 0),
    version integer NOT NULL DEFAULT 1
);

BEGIN;
INSERT INTO orders (id, total) VALUES (gen_random_uuid()::text, :'total')
RETURNING id AS order_id, total AS stored_total, version AS seq \gset
SELECT :"schema".enqueue('order', :'order_id', 'OrderChanged',
                         jsonb_build_object('order', :'order_id', 'total', :'stored_total', 'seq', :seq))
       AS event_id \gset
COMMIT;

\echo order :order_id placed, event :event_id
