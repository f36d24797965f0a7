-- postbox outbox, migration 0001.
--
-- Names are unqualified on purpose: the objects land in the first schema of search_path.
-- `postbox migrate --schema NAME` sets it for you; with your own migration tool, run
--     SET search_path TO your_schema;
-- before this file (and record the version the way your tool does).

-- Rows hash into a fixed number of shards by aggregate id. Each shard is drained by one relay replica at a
-- time, which is what keeps per-aggregate order with many replicas. 64 is fixed: changing it would move
-- aggregates between shards while rows are in flight. md5 is used (not hashtext) because it is documented
-- and stable across PostgreSQL versions and platforms.
CREATE FUNCTION outbox_shard_of(aggregate_id text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN ('x' || substr(md5(aggregate_id), 1, 8))::bit(32)::integer & 63;

CREATE TABLE outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- publish order
    event_id       uuid        NOT NULL DEFAULT gen_random_uuid(),   -- the message id consumers dedup on
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,                             -- the Kafka key
    event_type     text        NOT NULL,
    payload        jsonb,                                            -- JSON payloads ...
    payload_bytes  bytea,                                            -- ... or raw bytes (Avro, protobuf)
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,         -- become Kafka headers (trace context)
    topic          text,                                             -- explicit topic, overrides routing
    shard          integer     NOT NULL GENERATED ALWAYS AS (outbox_shard_of(aggregate_id)) STORED,
    created_at     timestamptz NOT NULL DEFAULT now(),
    state          text        NOT NULL DEFAULT 'pending',
    published_at   timestamptz,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    CONSTRAINT outbox_state_valid CHECK (state IN ('pending', 'published', 'failed')),
    CONSTRAINT outbox_one_payload CHECK (payload IS NULL OR payload_bytes IS NULL),
    CONSTRAINT outbox_headers_object CHECK (jsonb_typeof(headers) = 'object')
);

-- The relay's claim walks this index in id order; it holds only the rows still to publish.
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE state = 'pending';
-- Parked rows are few; `postbox relay status` and requeue find them here.
CREATE INDEX outbox_failed_idx ON outbox (id) WHERE state = 'failed';

-- One row per shard: which relay replica drains it, until when (database clock).
CREATE TABLE outbox_shard_lease (
    shard       integer PRIMARY KEY CHECK (shard BETWEEN 0 AND 63),
    owner       text,
    expires_at  timestamptz,
    acquired_at timestamptz
);
INSERT INTO outbox_shard_lease (shard) SELECT generate_series(0, 63);

-- Live relay replicas, so each can take its fair share of the shards.
CREATE TABLE outbox_relay_member (
    relay_id   text PRIMARY KEY,
    last_seen  timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    backend_pid integer
);

-- A wake-up hint for idle relays, once per statement (not per row). Delivery never depends on it: relays
-- poll as well. Turn it off with: ALTER TABLE outbox DISABLE TRIGGER outbox_notify;
CREATE FUNCTION outbox_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('postbox_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
