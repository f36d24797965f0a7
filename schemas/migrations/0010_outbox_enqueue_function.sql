-- Writing events from any language, and from triggers: enqueue() and enqueue_bytes(), in the outbox's
-- schema, write one outbox row in the caller's transaction and return its event id, with the checks the
-- Python API makes (a clear error for what cannot be stored, nothing written).
--
--     SELECT postbox.enqueue('order', '42', 'OrderPlaced', '{"id": 42}');
--     SELECT postbox.enqueue('order', '42', 'OrderPlaced', '{"id": 42}', '{"traceparent": "00-..."}');
--     SELECT postbox.enqueue_bytes('order', '42', 'OrderPlaced', '\x0a02...'::bytea);
--
-- SECURITY INVOKER (the default): the caller's own INSERT privilege on the outbox applies (the writer role
-- of deploy/sql/roles.sql has it, for exactly these columns). A NULL payload is a tombstone, as in Python.

CREATE FUNCTION outbox_check_event(aggregate_type text, aggregate_id text, event_type text, headers jsonb)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF aggregate_type IS NULL OR aggregate_type = '' THEN
        RAISE EXCEPTION 'enqueue: aggregate_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF aggregate_id IS NULL OR aggregate_id = '' THEN
        RAISE EXCEPTION 'enqueue: aggregate_id must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF event_type IS NULL OR event_type = '' THEN
        RAISE EXCEPTION 'enqueue: event_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'enqueue: headers must be a JSON object of strings' USING ERRCODE = '22023';
    END IF;
    -- Kafka headers are name/value strings; a client drops a header whose name is empty.
    IF EXISTS (SELECT FROM jsonb_each(headers) AS h WHERE h.key = '' OR jsonb_typeof(h.value) <> 'string') THEN
        RAISE EXCEPTION 'enqueue: headers must map non-empty names to strings' USING ERRCODE = '22023';
    END IF;
END;
$$;

-- The one body of both: checks, then the row (a JSON payload or a bytes one, never both).
CREATE FUNCTION outbox_write_event(aggregate_type text, aggregate_id text, event_type text, payload jsonb,
                                   payload_bytes bytea, headers jsonb, topic text)
    RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    new_event_id uuid := gen_random_uuid();
BEGIN
    PERFORM outbox_check_event(aggregate_type, aggregate_id, event_type, headers);
    INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers,
                        topic)
    VALUES (new_event_id, outbox_write_event.aggregate_type, outbox_write_event.aggregate_id,
            outbox_write_event.event_type, outbox_write_event.payload, outbox_write_event.payload_bytes,
            outbox_write_event.headers, outbox_write_event.topic);
    RETURN new_event_id;
END;
$$;

CREATE FUNCTION enqueue(aggregate_type text, aggregate_id text, event_type text, payload jsonb,
                        headers jsonb DEFAULT '{}', topic text DEFAULT NULL)
    RETURNS uuid
    LANGUAGE sql
    RETURN outbox_write_event(aggregate_type, aggregate_id, event_type, payload, NULL, headers, topic);

CREATE FUNCTION enqueue_bytes(aggregate_type text, aggregate_id text, event_type text, payload bytea,
                              headers jsonb DEFAULT '{}', topic text DEFAULT NULL)
    RETURNS uuid
    LANGUAGE sql
    RETURN outbox_write_event(aggregate_type, aggregate_id, event_type, NULL, payload, headers, topic);

-- The functions always write to this schema's outbox, whatever the caller's search_path.
DO $fix$
BEGIN
    EXECUTE format('ALTER FUNCTION enqueue(text, text, text, jsonb, jsonb, text) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION enqueue_bytes(text, text, text, bytea, jsonb, text) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_check_event(text, text, text, jsonb) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION outbox_write_event(text, text, text, jsonb, bytea, jsonb, text) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$fix$;
