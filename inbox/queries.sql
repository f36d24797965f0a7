-- The inbox consumer's SQL, loaded by name (relay.core.sql). search_path selects the schema.

-- name: claim_messages
-- The whole poll in one statement. Rows already present (redelivery, another consumer instance) and
-- repeats inside the batch are skipped; RETURNING names only the messages this transaction now owns.
INSERT INTO inbox_message AS i (consumer, message_id, topic, kafka_partition, kafka_offset, message_key,
                                processed_at)
SELECT %(consumer)s, m.id, m.topic, m.part, m.off, m.key, now()
FROM unnest(%(ids)s::text[], %(topics)s::text[], %(partitions)s::integer[], %(offsets)s::bigint[],
            %(keys)s::bytea[]) AS m(id, topic, part, off, key)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING i.message_id

-- name: mark_failed
UPDATE inbox_message SET status = 'failed', error = %(error)s, attempts = %(attempts)s
WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- name: prune_messages
DELETE FROM inbox_message
WHERE ctid IN (
    SELECT ctid FROM inbox_message
    WHERE received_at < now() - %(retention)s::interval
    LIMIT %(limit)s)

-- name: failed_messages
SELECT message_id, topic, kafka_partition, kafka_offset, attempts, error, received_at
FROM inbox_message WHERE consumer = %(consumer)s AND status = 'failed'
ORDER BY received_at LIMIT %(limit)s
