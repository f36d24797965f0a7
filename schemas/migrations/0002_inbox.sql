-- postbox inbox for Kafka messages, migration 0002 (same search_path convention as 0001).
--
-- Claim first, work second: a consumer inserts (consumer, message_id) with ON CONFLICT DO NOTHING in the
-- transaction that runs its handler, so a redelivered or concurrently delivered message changes nothing.
CREATE TABLE inbox_message (
    consumer     text        NOT NULL,   -- the consuming service's name (not the Kafka group id)
    message_id   text        NOT NULL,   -- the `id` header by default (the relay's event_id)
    topic        text        NOT NULL,
    kafka_partition integer  NOT NULL,
    kafka_offset bigint      NOT NULL,
    message_key  bytea,
    status       text        NOT NULL DEFAULT 'done',
    error        text,
    attempts     integer     NOT NULL DEFAULT 1,
    received_at  timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz,
    PRIMARY KEY (consumer, message_id),
    CONSTRAINT inbox_message_status_valid CHECK (status IN ('done', 'failed'))
);

-- Retention deletes in small batches by age (keep rows longer than any redelivery window).
CREATE INDEX inbox_message_received_at_idx ON inbox_message (received_at);
-- Parked messages are few; operators list them per consumer.
CREATE INDEX inbox_message_failed_idx ON inbox_message (consumer, received_at) WHERE status = 'failed';
