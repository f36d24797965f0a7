-- Writing many events in one call: enqueue_many(), in the outbox's schema, takes one array per argument of
-- enqueue() and writes one row per element, in the arrays' order, in the caller's transaction; it returns
-- the event ids in the same order. One statement for the batch where enqueue() is one per event, so a
-- batch costs about what a plain INSERT of its rows does (README "What each writer path costs").
--
--     SELECT postbox.enqueue_many(ARRAY['order', 'order'], ARRAY['42', '43'],
--                                 ARRAY['OrderPlaced', 'OrderPlaced'], ARRAY['{"id": 42}', '{"id": 43}']::jsonb[]);
--
-- headers and topic: NULL for every event's default ('{}', the routed topic), or arrays as long as the
-- others (a NULL topic element: that event's default; a NULL headers element is refused, as enqueue()
-- refuses NULL headers). Every event gets enqueue()'s checks, all of them before any row is written: the
-- first event that fails one is named in the error (SQLSTATE 22023), and nothing is written. A NULL payload
-- element is a tombstone. SECURITY INVOKER, as enqueue(): the caller's INSERT privilege applies.
--
-- The checks have one definition, outbox_event_problem() below, which enqueue() and enqueue_bytes() (through
-- outbox_write_event, redefined here over it), outbox_check_event (the same) and enqueue_many() all use,
-- their messages unchanged. It is a one-expression SQL function with no SET clause, so PostgreSQL inlines
-- it into the query or expression that calls it: no function call per event. It reads no table, and its
-- body is bound when it is created, so the caller's search_path does not matter to it.
--
-- enqueue() and enqueue_bytes() lose their SET search_path: their one-line bodies are bound to
-- outbox_write_event when created (whatever the search_path), and outbox_write_event keeps its own, so they
-- still write to this schema's outbox; without the setting PostgreSQL inlines them into the caller's
-- statement. With the check no longer a second plpgsql call, a call of enqueue() costs about 10 us more than
-- a plain one-row INSERT on the project's machine, against 30 before.

CREATE FUNCTION outbox_event_problem(aggregate_type text, aggregate_id text, event_type text, headers jsonb)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN aggregate_type IS NULL OR aggregate_type = '' THEN 'aggregate_type must be a non-empty text'
        WHEN aggregate_id IS NULL OR aggregate_id = '' THEN 'aggregate_id must be a non-empty text'
        WHEN event_type IS NULL OR event_type = '' THEN 'event_type must be a non-empty text'
        WHEN headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN 'headers must be a JSON object of strings'
        -- Kafka headers are name/value strings; a client drops a header whose name is empty. (silent: a
        -- constant argument may be folded before the CASE would have stopped at a non-object above.)
        WHEN headers <> '{}' AND jsonb_path_exists(
                headers, 'strict $.keyvalue() ? (@.key == "" || @.value.type() != "string")', '{}', true)
            THEN 'headers must map non-empty names to strings'
    END;

CREATE OR REPLACE FUNCTION outbox_check_event(aggregate_type text, aggregate_id text, event_type text,
                                              headers jsonb)
    RETURNS void
    LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    problem constant text := outbox_event_problem(aggregate_type, aggregate_id, event_type, headers);
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue: %', problem USING ERRCODE = '22023';
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_write_event(aggregate_type text, aggregate_id text, event_type text,
                                              payload jsonb, payload_bytes bytea, headers jsonb, topic text)
    RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    new_event_id uuid := gen_random_uuid();
    problem constant text := outbox_event_problem(aggregate_type, aggregate_id, event_type, headers);
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue: %', problem USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers,
                        topic)
    VALUES (new_event_id, outbox_write_event.aggregate_type, outbox_write_event.aggregate_id,
            outbox_write_event.event_type, outbox_write_event.payload, outbox_write_event.payload_bytes,
            outbox_write_event.headers, outbox_write_event.topic);
    RETURN new_event_id;
END;
$$;

ALTER FUNCTION enqueue(text, text, text, jsonb, jsonb, text) RESET search_path;
ALTER FUNCTION enqueue_bytes(text, text, text, bytea, jsonb, text) RESET search_path;

CREATE FUNCTION enqueue_many(aggregate_type text[], aggregate_id text[], event_type text[], payload jsonb[],
                             headers jsonb[] DEFAULT NULL, topic text[] DEFAULT NULL)
    RETURNS uuid[]
    LANGUAGE plpgsql AS $$
DECLARE
    events constant integer := cardinality(enqueue_many.aggregate_type);
    event_ids uuid[];
    bad_event bigint;
    bad_problem text;
BEGIN
    IF enqueue_many.aggregate_type IS NULL OR enqueue_many.aggregate_id IS NULL
            OR enqueue_many.event_type IS NULL OR enqueue_many.payload IS NULL THEN
        RAISE EXCEPTION 'enqueue_many: aggregate_type, aggregate_id, event_type and payload must be arrays, '
                        'not NULL' USING ERRCODE = '22023';
    END IF;
    IF array_ndims(enqueue_many.aggregate_type) > 1 OR array_ndims(enqueue_many.aggregate_id) > 1
            OR array_ndims(enqueue_many.event_type) > 1 OR array_ndims(enqueue_many.payload) > 1
            OR array_ndims(enqueue_many.headers) > 1 OR array_ndims(enqueue_many.topic) > 1 THEN
        RAISE EXCEPTION 'enqueue_many: the arrays must be one-dimensional' USING ERRCODE = '22023';
    END IF;
    IF cardinality(enqueue_many.aggregate_id) <> events OR cardinality(enqueue_many.event_type) <> events
            OR cardinality(enqueue_many.payload) <> events OR cardinality(enqueue_many.headers) <> events
            OR cardinality(enqueue_many.topic) <> events THEN
        RAISE EXCEPTION 'enqueue_many: the arrays must have one element per event (aggregate_type has %)', events
            USING ERRCODE = '22023';
    END IF;
    IF events = 0 THEN
        RETURN '{}';
    END IF;
    -- One pass over the arrays before any row is written: every event's checks (the first failure is
    -- named) and the events' ids (made here, not returned by the INSERT: RETURNING would need SELECT on the
    -- outbox, which the writer role does not have).
    SELECT array_agg(gen_random_uuid()), min(c.n) FILTER (WHERE c.problem IS NOT NULL),
           (array_agg(c.problem ORDER BY c.n) FILTER (WHERE c.problem IS NOT NULL))[1]
      INTO event_ids, bad_event, bad_problem
      FROM (SELECT u.n, outbox_event_problem(u.t, u.i, u.e,
                                             CASE WHEN enqueue_many.headers IS NULL THEN '{}' ELSE u.h END)
              FROM unnest(enqueue_many.aggregate_type, enqueue_many.aggregate_id, enqueue_many.event_type,
                          enqueue_many.headers) WITH ORDINALITY AS u(t, i, e, h, n)) AS c(n, problem);
    IF bad_problem IS NOT NULL THEN
        RAISE EXCEPTION 'enqueue_many: event % of %: %', bad_event, events, bad_problem USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic)
    SELECT u.id, u.t, u.i, u.e, u.p, CASE WHEN enqueue_many.headers IS NULL THEN '{}' ELSE u.h END, u.o
    FROM unnest(event_ids, enqueue_many.aggregate_type, enqueue_many.aggregate_id, enqueue_many.event_type,
                enqueue_many.payload, enqueue_many.headers, enqueue_many.topic)
         WITH ORDINALITY AS u(id, t, i, e, p, h, o, n)
    ORDER BY u.n;
    RETURN event_ids;
END;
$$;

-- As in 0010: the functions always write to this schema's outbox, whatever the caller's search_path
-- (the settings of the two replaced functions are set again: CREATE OR REPLACE cleared them).
DO $fix$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_write_event(text, text, text, jsonb, bytea, jsonb, text) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION enqueue_many(text[], text[], text[], jsonb[], jsonb[], text[]) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_check_event(text, text, text, jsonb) SET search_path = %I, pg_temp',
                   current_schema());
END
$fix$;
