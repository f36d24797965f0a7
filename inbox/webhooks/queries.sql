-- The webhook inbox's SQL, loaded by name (relay.core.sql). search_path selects the schema.

-- name: insert_events
-- The whole request in one statement: repeats inside a batch, redeliveries and Stripe twins (the partial
-- unique index on twin_key) are skipped; RETURNING names the rows this statement stored. The arrays go in
-- binary: quoting each element as text cost the receiver more than the rest of the statement.
-- Rows are inserted (and locked until the statement commits) in key order, as the inbox's claim_messages
-- does and for the same reason: two statements storing the same events (concurrent requests, a provider's
-- retry, reconciliation) wait for each other in one direction only, never deadlock on the primary key.
-- Twin keys do not follow that order; the rare deadlock through them is retried by the receiver.
INSERT INTO webhook_inbox (provider, event_id, event_type, payload, headers, twin_key)
SELECT e.provider, e.id, e.type, e.payload, e.headers, e.twin
FROM unnest(%(providers)b::text[], %(ids)b::text[], %(types)b::text[], %(payloads)b::jsonb[],
            %(headers)b::jsonb[], %(twins)b::text[]) WITH ORDINALITY AS e(provider, id, type, payload, headers,
                                                                          twin, n)
ORDER BY e.provider COLLATE "C", e.id COLLATE "C", e.n
ON CONFLICT DO NOTHING
RETURNING provider, event_id

-- name: claim_events
-- Take pending rows nobody else holds, oldest first, and flip them to processing in one statement.
WITH next AS (
    SELECT provider, event_id FROM webhook_inbox
    WHERE status = 'pending' AND (not_before IS NULL OR not_before <= now())
    ORDER BY received_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE webhook_inbox AS w
SET status = 'processing', locked_at = now(), attempts = w.attempts + 1
FROM next
WHERE w.provider = next.provider AND w.event_id = next.event_id
RETURNING w.provider, w.event_id, w.event_type, w.payload, w.headers, w.attempts, w.received_at

-- name: mark_done
-- In the handler's transaction. The attempts check fences a worker whose row the reaper handed to
-- another: its mark changes nothing, and it rolls its handler's work back.
UPDATE webhook_inbox SET status = 'done', processed_at = now(), locked_at = NULL, last_error = NULL
WHERE provider = %(provider)s AND event_id = %(event_id)s AND status = 'processing' AND attempts = %(attempts)s

-- name: mark_failed_attempt
UPDATE webhook_inbox
SET status = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s THEN 'failed' ELSE 'pending' END,
    last_error = %(error)s,
    locked_at = NULL,
    not_before = now() + %(retry_in)s::interval
WHERE provider = %(provider)s AND event_id = %(event_id)s AND status = 'processing' AND attempts = %(attempts)s
RETURNING status

-- name: release_transient
-- In a transaction of its own, after the handler's was rolled back by a transient database error (a
-- deadlock, a lock timeout, a serialization failure): back to pending without spending an attempt (the
-- claim counted one), after a jittered wait. Fenced on attempts like mark_done.
UPDATE webhook_inbox
SET status = 'pending',
    attempts = attempts - 1,
    last_error = %(error)s,
    locked_at = NULL,
    not_before = now() + %(retry_in)s::interval
WHERE provider = %(provider)s AND event_id = %(event_id)s AND status = 'processing' AND attempts = %(attempts)s
RETURNING status

-- name: reap_stuck
-- Rows a worker took and never finished (it died or hung): back to pending, or failed once they have
-- used up their attempts (a poison event that kills its worker every time).
-- Every worker reaps, so two reapers meet; and a row can be locked by its worker marking it done right
-- now, or by an operator. A plain UPDATE would wait for such a row (into a lock timeout, or a deadlock
-- with another reaper that locked the same rows in another order). Locked rows are skipped instead, in
-- key order: a row its worker is finishing needs no reaping, and any other comes back at the next pass.
WITH stuck AS (
    SELECT provider, event_id FROM webhook_inbox
    WHERE status = 'processing' AND locked_at < now() - %(visibility)s::interval
    ORDER BY provider, event_id
    FOR UPDATE SKIP LOCKED
)
UPDATE webhook_inbox AS w
SET status = CASE WHEN w.attempts >= %(max_attempts)s THEN 'failed' ELSE 'pending' END,
    last_error = CASE WHEN w.attempts >= %(max_attempts)s
                      THEN 'abandoned by its worker ' || w.attempts || ' times (crash or timeout)'
                      ELSE coalesce(w.last_error, 'returned by the reaper') END,
    locked_at = NULL
FROM stuck
WHERE w.provider = stuck.provider AND w.event_id = stuck.event_id
RETURNING w.provider, w.event_id, w.status

-- name: oldest_pending_age
SELECT coalesce(extract(epoch FROM now() - min(received_at)), 0)::float8 FROM webhook_inbox WHERE status = 'pending'

-- name: prune_events
DELETE FROM webhook_inbox
WHERE ctid IN (
    SELECT ctid FROM webhook_inbox
    -- Failed events were never applied: they go only when asked for by a flag of their own.
    WHERE received_at < now() - %(retention)s::interval
      AND (status = 'done' OR (status = 'failed' AND %(include_failed)s::boolean))
    LIMIT %(limit)s)

-- name: status_by_provider
SELECT provider, status, count(*), coalesce(extract(epoch FROM now() - min(received_at)), 0)::float8
FROM webhook_inbox GROUP BY provider, status ORDER BY provider, status

-- name: failed_events
SELECT provider, event_id, event_type, attempts, last_error
FROM webhook_inbox WHERE status = 'failed' ORDER BY received_at LIMIT %(limit)s

-- name: requeue_events
-- Failed events back to pending with their attempts reset, so they get the full max_attempts again.
-- Every filter that is given must match (NULL means "any").
UPDATE webhook_inbox
SET status = 'pending', attempts = 0, not_before = NULL, locked_at = NULL,
    last_error = 'requeued after: ' || coalesce(last_error, '')
WHERE status = 'failed'
  AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
  AND (%(event_ids)s::text[] IS NULL OR event_id = ANY (%(event_ids)s::text[]))
  AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
  AND (%(error_like)s::text IS NULL OR last_error LIKE %(error_like)s::text)
RETURNING provider, event_id
