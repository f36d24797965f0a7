-- postbox webhook inbox, migration 0003 (same search_path convention as 0001).
--
-- Receive fast, process later: the HTTP receiver inserts verified events with ON CONFLICT DO NOTHING and
-- answers 2xx; workers drain pending rows with FOR UPDATE SKIP LOCKED.
CREATE TABLE webhook_inbox (
    provider     text        NOT NULL,
    event_id     text        NOT NULL,   -- the provider's documented id (Stripe event id, Shopify webhook id,
                                         -- Marqeta <kind>:<token>)
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,  -- provider headers worth keeping (no secrets)
    twin_key     text,                   -- second dedup layer (Stripe twin events)
    status       text        NOT NULL DEFAULT 'pending',
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    received_at  timestamptz NOT NULL DEFAULT now(),
    not_before   timestamptz,            -- retry backoff: not claimed before this
    locked_at    timestamptz,            -- when a worker took it; the reaper returns stale ones
    processed_at timestamptz,
    PRIMARY KEY (provider, event_id),
    CONSTRAINT webhook_inbox_status_valid CHECK (status IN ('pending', 'processing', 'done', 'failed'))
);

CREATE UNIQUE INDEX webhook_inbox_twin_idx ON webhook_inbox (provider, twin_key) WHERE twin_key IS NOT NULL;
CREATE INDEX webhook_inbox_pending_idx ON webhook_inbox (received_at) WHERE status = 'pending';
CREATE INDEX webhook_inbox_processing_idx ON webhook_inbox (locked_at) WHERE status = 'processing';
CREATE INDEX webhook_inbox_received_at_idx ON webhook_inbox (received_at);  -- retention
