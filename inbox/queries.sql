-- The inbox consumer's SQL, loaded by name (relay.core.sql). search_path selects the schema.

-- name: claim_messages
-- The whole poll in one statement. Rows already present (redelivery, another consumer instance) and
-- repeats inside the batch are skipped; RETURNING names only the messages this transaction now owns.
-- The arrays are sent in binary format: in text format psycopg quotes and escapes every element in Python,
-- about a third of the claim's time at 500 ids.
-- Rows are inserted, and so locked until the batch commits, in message id order: PostgreSQL inserts the
-- rows of INSERT ... SELECT ... ORDER BY in that order (RETURNING shows it). Two consumers claiming the
-- same ids (one id on two partitions after a producer retry) then wait for each other in one direction
-- only, never in a cycle: a claim waits at its first id the other holds, and holds no later one.
-- COLLATE "C" is byte order, the same as Python's sort of the ids (the consumer's one-by-one fallback);
-- ordinality keeps a repeat inside the batch at its first place, whose coordinates are stored.
INSERT INTO inbox_message AS i (consumer, message_id, topic, kafka_partition, kafka_offset, message_key,
                                processed_at)
SELECT %(consumer)s, m.id, m.topic, m.part, m.off, m.key, now()
FROM unnest(%(ids)b::text[], %(topics)b::text[], %(partitions)b::integer[], %(offsets)b::bigint[],
            %(keys)b::bytea[]) WITH ORDINALITY AS m(id, topic, part, off, key, n)
ORDER BY m.id COLLATE "C", m.n
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING i.message_id

-- name: mark_failed
UPDATE inbox_message SET status = 'failed', error = %(error)s, attempts = %(attempts)s
WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- name: prune_messages
-- Parked (failed) messages were never applied: they go only when asked for by a flag of their own.
DELETE FROM inbox_message
WHERE ctid IN (
    SELECT ctid FROM inbox_message
    WHERE received_at < now() - %(retention)s::interval
      AND (status <> 'failed' OR %(include_failed)s::boolean)
    LIMIT %(limit)s)

-- name: failed_messages
-- The parked messages of one consumer (or of all, consumer NULL), oldest first.
SELECT consumer, message_id, topic, kafka_partition, kafka_offset, attempts, error
FROM inbox_message
WHERE status = 'failed' AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
ORDER BY received_at LIMIT %(limit)s

-- name: consumer_status
-- Per consumer: messages processed, parked, the oldest parked one's age, the last processing time.
SELECT consumer,
       count(*) FILTER (WHERE status = 'done'),
       count(*) FILTER (WHERE status = 'failed'),
       coalesce(extract(epoch FROM now() - min(received_at) FILTER (WHERE status = 'failed')), 0)::float8,
       max(processed_at)
FROM inbox_message
WHERE %(consumer)s::text IS NULL OR consumer = %(consumer)s::text
GROUP BY consumer
ORDER BY consumer

-- name: parked_to_requeue
-- The parked messages a requeue takes, locked so two requeues never run one message twice. Every filter
-- that is given must match (NULL means "any").
SELECT message_id, topic, kafka_partition, kafka_offset
FROM inbox_message
WHERE consumer = %(consumer)s AND status = 'failed'
  AND (%(ids)s::text[] IS NULL OR message_id = ANY (%(ids)s::text[]))
  AND (%(error_like)s::text IS NULL OR error LIKE %(error_like)s::text)
ORDER BY topic, kafka_partition, kafka_offset
FOR UPDATE SKIP LOCKED

-- name: mark_requeued_done
UPDATE inbox_message
SET status = 'done', error = NULL, attempts = attempts + 1, processed_at = now()
WHERE consumer = %(consumer)s AND message_id = %(message_id)s AND status = 'failed'
