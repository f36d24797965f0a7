-- The size of each row's Kafka message, computed once when the row is written, so the relay's claim can
-- cut a batch at a byte budget and leave a row over the producer's message.max.bytes unloaded (parked
-- with its reason) without converting every claimed payload to text first. Writers cannot set it
-- (GENERATED ALWAYS), so no writer can make a large row look small.
-- Adding a stored generated column rewrites the outbox and blocks writes to it meanwhile: on a large one,
-- prune published rows first (`postbox relay prune`).
ALTER TABLE outbox ADD COLUMN message_bytes bigint GENERATED ALWAYS AS (
    coalesce(octet_length(payload::text), octet_length(payload_bytes), 0)
    + octet_length(aggregate_type) + octet_length(aggregate_id) + octet_length(event_type)
    + coalesce(octet_length(topic), 0) + octet_length(headers::text)
) STORED;
