-- Change-data capture of business tables (`postbox capture add`): every committed INSERT, UPDATE and
-- DELETE of a captured table becomes an event in Debezium's format (PostgreSQL connector, JSON converter
-- with schemas.enable=false), written to this outbox by a trigger in the writer's own transaction. The
-- relay publishes it like any outbox row: in commit order per key (log mode reads commit order), across
-- replicas, with leases, parking, metrics and retention. No replication slot, no wal_level=logical.
--
-- How an event is made: one statement-level AFTER trigger per operation, with transition tables, renders
-- the statement's rows set-based (one INSERT into the outbox per statement, not one per row). The
-- rendering is built from the catalog at each statement, so `ALTER TABLE ... ADD/DROP COLUMN` gives the
-- new shape from the next change, as Debezium does. The value is rendered here, as the bytes Kafka
-- Connect's JsonConverter writes (payload_bytes): the relay sends them unchanged.
--
-- The capture runs SECURITY DEFINER, as the owner of this schema: a writer of a captured table needs no
-- right on the outbox. It writes only for tables registered in outbox_capture (by `postbox capture add`,
-- which needs the table's owner, or TRIGGER on it, and INSERT on outbox_capture).

CREATE TABLE outbox_capture (
    table_id        regclass PRIMARY KEY,          -- the captured table (dump/restore keeps it by name)
    topic_prefix    text NOT NULL,                 -- Debezium's topic.prefix: topics are PREFIX.SCHEMA.TABLE
    columns         text[],                        -- only these columns (NULL: all)
    exclude_columns text[],                        -- all but these
    key_columns     text[],                        -- the message key (NULL: the primary key)
    options         jsonb NOT NULL DEFAULT '{}',   -- Debezium's option names (outbox_capture_check_options)
    source_version  text NOT NULL,                 -- source.version of the events
    added_at        timestamptz NOT NULL DEFAULT now(),
    -- `postbox capture snapshot`: the key (as text, in key order) of the last row emitted as a read
    -- event, committed with that chunk's events, so a snapshot resumes after a crash.
    snapshot_after  text[],
    snapshot_started_at timestamptz,
    snapshot_done_at    timestamptz,
    -- The table's trigger function (outbox_capture_make_function), named once, when first captured: the
    -- name outlives a dump and restore, which gives the table another oid.
    trigger_function text,
    CONSTRAINT outbox_capture_prefix CHECK (topic_prefix ~ '^[A-Za-z0-9._-]+$'),
    CONSTRAINT outbox_capture_one_list CHECK (columns IS NULL OR exclude_columns IS NULL)
);

-- A JSON string as Jackson (Kafka Connect's JSON converter) writes it: PostgreSQL's to_json, except that
-- Jackson escapes control characters with upper-case hex (\u001B) and characters beyond U+FFFF as two
-- escaped UTF-16 surrogates. The rare text with either takes the slow path, character by character.
-- (The renderers below are not STRICT, and give NULL for NULL by themselves: PostgreSQL inlines them into
-- the capture's statements only so.)
CREATE FUNCTION outbox_capture_json_string_slow(value text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN '"' || (
        SELECT string_agg(
            CASE
                WHEN ch = '"' THEN '\"'
                WHEN ch = '\' THEN '\\'
                WHEN code = 8 THEN '\b'
                WHEN code = 9 THEN '\t'
                WHEN code = 10 THEN '\n'
                WHEN code = 12 THEN '\f'
                WHEN code = 13 THEN '\r'
                WHEN code < 32 THEN '\u00' || upper(lpad(to_hex(code), 2, '0'))
                WHEN code > 65535 THEN
                    '\u' || upper(to_hex(55296 + ((code - 65536) >> 10)))
                    || '\u' || upper(to_hex(56320 + ((code - 65536) & 1023)))
                ELSE ch
            END, '' ORDER BY position)
        FROM regexp_split_to_table(value, '') WITH ORDINALITY AS chars(ch, position),
             LATERAL ascii(ch) AS code
    ) || '"';

CREATE FUNCTION outbox_capture_json_string(value text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE  -- to_json is STABLE; IMMUTABLE would stop the inlining
    RETURN CASE WHEN value ~ '[\x01-\x07\x0b\x0e-\x1f\U00010000-\U0010ffff]'
                THEN outbox_capture_json_string_slow(value)
                ELSE to_json(value)::text END;

-- A value's text by its type's output function: never a cast, which a type's owner could define (CREATE
-- CAST needs no more than owning the type) to run code of theirs in the capture's SECURITY DEFINER trigger.
CREATE FUNCTION outbox_capture_text(value anyelement) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN value IS DISTINCT FROM NULL THEN pg_catalog.concat(value) END  -- (a row of nulls is a value)
$$;

-- A float as Java's Float.toString / Double.toString writes it (what the JSON converter writes), from
-- PostgreSQL's shortest text (extra_float_digits = 1, set on the trigger): plain from 10^-3 up to 10^7
-- ("123.0", "0.001"), else d.dddE±n ("1.0E7", "1.0E-4"); NaN and the infinities as strings, as Jackson
-- writes them; -0 as 0.0 (what Debezium sends for it).
CREATE FUNCTION outbox_capture_java_float(value text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    parts text[] := regexp_match(value, '^(-?)([0-9]+)(?:\.([0-9]+))?(?:e([-+][0-9]+))?$');
    digits text;
    point integer;  -- the value is 0.DIGITS x 10^point
    exponent integer;
BEGIN
    IF parts IS NULL THEN  -- NaN, Infinity, -Infinity
        RETURN '"' || value || '"';
    END IF;
    digits := parts[2] || coalesce(parts[3], '');
    point := length(parts[2]) + coalesce(parts[4]::integer, 0);
    point := point - (length(digits) - length(ltrim(digits, '0')));
    digits := rtrim(ltrim(digits, '0'), '0');
    IF digits = '' THEN
        RETURN '0.0';
    END IF;
    exponent := point - 1;
    IF exponent >= -3 AND exponent < 7 THEN
        IF point <= 0 THEN
            RETURN parts[1] || '0.' || repeat('0', -point) || digits;
        ELSIF point >= length(digits) THEN
            RETURN parts[1] || digits || repeat('0', point - length(digits)) || '.0';
        END IF;
        RETURN parts[1] || substr(digits, 1, point) || '.' || substr(digits, point + 1);
    END IF;
    RETURN parts[1] || substr(digits, 1, 1) || '.' || coalesce(nullif(substr(digits, 2), ''), '0')
           || 'E' || exponent;
END;
$$;

-- An integer as Java's BigInteger.toByteArray (big-endian two's complement, fewest bytes), in base64:
-- the JSON converter's rendering of a Connect Decimal's unscaled value. Within bigint's range (almost
-- every value) the bytes are int8send's last ones; beyond it, a loop.
CREATE FUNCTION outbox_capture_unscaled_base64_wide(unscaled numeric) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    width integer := 1;
    rest numeric;
    hex text := '';
BEGIN
    WHILE unscaled < -(2::numeric ^ (8 * width - 1)) OR unscaled >= 2::numeric ^ (8 * width - 1) LOOP
        width := width + 1;
    END LOOP;
    rest := CASE WHEN unscaled < 0 THEN unscaled + 2::numeric ^ (8 * width) ELSE unscaled END;
    FOR i IN 1..width LOOP
        hex := lpad(to_hex(mod(rest, 256)::integer), 2, '0') || hex;
        rest := div(rest, 256);
    END LOOP;
    RETURN translate(encode(decode(hex, 'hex'), 'base64'), E'\n', '');
END;
$$;

CREATE FUNCTION outbox_capture_unscaled_base64(unscaled numeric) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN unscaled < -9223372036854775808 OR unscaled > 9223372036854775807
            THEN outbox_capture_unscaled_base64_wide(unscaled)
        ELSE encode(substr(int8send(unscaled::bigint), 9 - CASE
            WHEN unscaled BETWEEN -128 AND 127 THEN 1
            WHEN unscaled BETWEEN -32768 AND 32767 THEN 2
            WHEN unscaled BETWEEN -8388608 AND 8388607 THEN 3
            WHEN unscaled BETWEEN -2147483648 AND 2147483647 THEN 4
            WHEN unscaled BETWEEN -549755813888 AND 549755813887 THEN 5
            WHEN unscaled BETWEEN -140737488355328 AND 140737488355327 THEN 6
            WHEN unscaled BETWEEN -36028797018963968 AND 36028797018963967 THEN 7
            ELSE 8 END), 'base64')
    END;

-- numeric(p, s) and money under decimal.handling.mode=precise: the unscaled value in base64. NaN and the
-- infinities have none: null, as Debezium sends.
CREATE FUNCTION outbox_capture_decimal(value numeric, scale integer) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN value IN ('NaN', 'Infinity', '-Infinity') THEN NULL
                ELSE '"' || outbox_capture_unscaled_base64(value * 10::numeric ^ scale) || '"' END;

-- numeric without a scale (Debezium's VariableScaleDecimal): {"scale":S,"value":"base64"}, the scale
-- with trailing zeros dropped (12.500 is scale 1), as Debezium sends it.
CREATE FUNCTION outbox_capture_variable_decimal(value numeric) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN value IN ('NaN', 'Infinity', '-Infinity') THEN NULL
                ELSE '{"scale":' || scale(trim_scale(value)) || ',"value":"'
                     || outbox_capture_unscaled_base64(trim_scale(value) * 10::numeric ^ scale(trim_scale(value)))
                     || '"}' END;

-- An interval as Debezium's MicroDuration: microseconds, a month counted as 365.25 / 12 days.
CREATE FUNCTION outbox_capture_interval_micros(value interval) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN round(((extract(year FROM value) * 12 + extract(month FROM value)) * 30.4375
                  + extract(day FROM value)) * 86400000000
                 + (extract(hour FROM value) * 3600 + extract(minute FROM value) * 60) * 1000000
                 + extract(microseconds FROM value))::bigint::text;

-- The SQL expression that renders `expr` (of type type_id, type modifier typmod) as Debezium's JSON value
-- (NULL for SQL NULL). Built once per statement; `options` are the capture's (Debezium's names).
CREATE FUNCTION outbox_capture_value_sql(expr text, type_id oid, typmod integer, options jsonb)
    RETURNS text
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    t pg_type;
    precision integer;
    time_mode text := coalesce(options ->> 'time.precision.mode', 'adaptive');
    decimal_mode text := coalesce(options ->> 'decimal.handling.mode', 'precise');
BEGIN
    SELECT * INTO t FROM pg_type WHERE oid = type_id;
    IF t.typtype = 'd' THEN  -- a domain: its base type's rendering
        RETURN outbox_capture_value_sql(expr, t.typbasetype, t.typtypmod, options);
    END IF;
    IF t.typtype = 'e' THEN
        RETURN format('outbox_capture_json_string(outbox_capture_text(%s))', expr);
    END IF;
    IF t.typcategory = 'A' AND t.typelem <> 0 THEN
        RETURN format('CASE WHEN (%1$s) IS NULL THEN NULL ELSE coalesce((SELECT ''['' || string_agg('
                      'coalesce(%2$s, ''null''), '','' ORDER BY pbx_n) || '']'' FROM unnest(%1$s) '
                      'WITH ORDINALITY AS pbx_u(pbx_e, pbx_n)), ''[]'') END',
                      expr, outbox_capture_value_sql('pbx_u.pbx_e', t.typelem, typmod, options));
    END IF;
    precision := CASE WHEN typmod < 0 THEN 6 ELSE typmod END;  -- time, timestamp(tz): fraction digits
    CASE type_id
        WHEN 'int2'::regtype, 'int4'::regtype, 'int8'::regtype, 'oid'::regtype, 'bool'::regtype THEN
            RETURN format('(%s)::text', expr);
        WHEN 'float4'::regtype, 'float8'::regtype THEN
            RETURN format('outbox_capture_java_float((%s)::text)', expr);
        WHEN 'numeric'::regtype, 'money'::regtype THEN
            IF decimal_mode = 'double' THEN  -- beyond float8's range: an infinity, as Java's parse gives
                RETURN format('outbox_capture_java_float(CASE WHEN abs((%1$s)::numeric) > 1.7976931348623157e308 '
                              'AND (%1$s)::numeric NOT IN (''NaN'', ''Infinity'', ''-Infinity'') '
                              'THEN CASE WHEN (%1$s)::numeric > 0 THEN ''Infinity'' ELSE ''-Infinity'' END '
                              'ELSE (%1$s)::numeric::float8::text END)', expr);
            ELSIF decimal_mode = 'string' THEN  -- NaN and the infinities by Debezium's names for them
                RETURN format('outbox_capture_json_string(CASE (%1$s)::numeric WHEN ''NaN'' THEN ''NAN'' '
                              'WHEN ''Infinity'' THEN ''POSITIVE_INFINITY'' WHEN ''-Infinity'' THEN ''NEGATIVE_INFINITY'' '
                              'ELSE (%1$s)::numeric::text END)', expr);
            ELSIF type_id = 'money'::regtype THEN
                RETURN format('outbox_capture_decimal((%s)::numeric, 2)', expr);
            ELSIF typmod < 0 THEN
                RETURN format('outbox_capture_variable_decimal(%s)', expr);
            END IF;
            RETURN format('outbox_capture_decimal(%s, %s)', expr, (typmod - 4) & 65535);
        WHEN 'bpchar'::regtype THEN  -- char(n) keeps its padding, which a cast to text drops
            RETURN format('outbox_capture_json_string(outbox_capture_text(%s))', expr);
        WHEN 'json'::regtype, 'jsonb'::regtype THEN
            RETURN format('outbox_capture_json_string((%s)::text)', expr);
        WHEN 'bytea'::regtype THEN
            RETURN format('''"'' || translate(encode(%s, ''base64''), E''\n'', '''') || ''"''', expr);
        WHEN 'date'::regtype THEN
            RETURN format('CASE WHEN isfinite(%1$s) THEN ((%1$s) - DATE ''1970-01-01'')::text END', expr);
        WHEN 'time'::regtype, 'timestamp'::regtype THEN
            IF time_mode = 'connect' OR (time_mode = 'adaptive' AND precision <= 3)
               OR (time_mode = 'adaptive_time_microseconds' AND type_id = 'timestamp'::regtype AND precision <= 3) THEN
                RETURN format('CASE WHEN isfinite(%1$s) THEN floor(extract(epoch FROM %1$s) * 1000)::bigint::text END', expr);
            END IF;
            RETURN format('CASE WHEN isfinite(%1$s) THEN floor(extract(epoch FROM %1$s) * 1000000)::bigint::text END', expr);
        WHEN 'timestamptz'::regtype THEN
            -- ZonedTimestamp: ISO-8601 in UTC, with as many fraction digits as the column keeps.
            RETURN format('''"'' || substr(to_char((%s) AT TIME ZONE ''UTC'', ''YYYY-MM-DD"T"HH24:MI:SS.US''), 1, %s) || ''Z"''',
                          expr, 19 + CASE WHEN precision = 0 THEN 0 ELSE precision + 1 END);
        WHEN 'timetz'::regtype THEN
            RETURN format('''"'' || ((%s) AT TIME ZONE ''UTC'')::time::text || ''Z"''', expr);
        WHEN 'interval'::regtype THEN
            RETURN format('outbox_capture_interval_micros(%s)', expr);
        ELSE
            -- A built-in type's cast to text is PostgreSQL's own (only the type's owner may make one), and
            -- costs less than the output function's call.
            IF type_id < 16384 THEN
                RETURN format('outbox_capture_json_string((%s)::text)', expr);
            END IF;
            RETURN format('outbox_capture_json_string(outbox_capture_text(%s))', expr);
    END CASE;
END;
$$;

-- The captured columns of a table, in table order: what an event's before/after hold. Generated columns
-- are left out, as PostgreSQL's logical replication leaves them out by default.
CREATE FUNCTION outbox_capture_columns(capture outbox_capture)
    RETURNS TABLE (name text, type_id oid, typmod integer)
    LANGUAGE sql STABLE AS $$
    SELECT a.attname::text, a.atttypid, a.atttypmod
    FROM pg_attribute AS a
    WHERE a.attrelid = capture.table_id AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
      AND (capture.columns IS NULL OR a.attname = ANY (capture.columns))
      AND (capture.exclude_columns IS NULL OR a.attname <> ALL (capture.exclude_columns))
    ORDER BY a.attnum
$$;

-- The key's columns: those named at `capture add`, else the primary key's, in its order.
CREATE FUNCTION outbox_capture_key_columns(capture outbox_capture)
    RETURNS TABLE (name text, type_id oid, typmod integer)
    LANGUAGE sql STABLE AS $$
    SELECT a.attname::text, a.atttypid, a.atttypmod
    FROM unnest(coalesce(capture.key_columns, (
             SELECT array_agg(pa.attname::text ORDER BY pk.position)
             FROM pg_index AS i
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS pk(attnum, position)
             JOIN pg_attribute AS pa ON pa.attrelid = i.indrelid AND pa.attnum = pk.attnum
             WHERE i.indrelid = capture.table_id AND i.indisprimary))) WITH ORDINALITY AS k(name, position)
    JOIN pg_attribute AS a ON a.attrelid = capture.table_id AND a.attname = k.name AND NOT a.attisdropped
    ORDER BY k.position
$$;

-- The SQL expression that renders row `alias` of the captured table as a JSON object: its key columns
-- (key) or its captured columns, in their order, compact as Jackson writes it.
CREATE FUNCTION outbox_capture_object_sql(capture outbox_capture, alias text, key boolean) RETURNS text
    LANGUAGE sql STABLE AS $$
    -- Parenthesised runs of 45 columns joined by ||: the expression stays shallow for the parser (a table
    -- of 1,600 columns is a chain of 36 runs, where one chain of || would be 3,200 deep), and || costs
    -- less than concat(), which calls each part's output function.
    SELECT '''{'' || ' || coalesce(string_agg(chunk, ' || ' ORDER BY chunk_no), '''''') || ' || ''}'''
    FROM (SELECT c.position / 45 AS chunk_no,
                 '(' || string_agg(
                     quote_literal(CASE WHEN c.position = 0 THEN '' ELSE ',' END
                                   || outbox_capture_json_string(c.name) || ':')
                     || format(' || coalesce(%s, ''null'')',
                               outbox_capture_value_sql(format('%I.%I', alias, c.name), c.type_id, c.typmod,
                                                        capture.options)),
                     ' || ' ORDER BY c.position) || ')' AS chunk
          FROM (SELECT listed.*, row_number() OVER () - 1 AS position
                FROM (SELECT * FROM outbox_capture_key_columns(capture) WHERE key
                      UNION ALL
                      SELECT * FROM outbox_capture_columns(capture) WHERE NOT key) AS listed) AS c
          GROUP BY c.position / 45) AS chunks
$$;

-- Debezium's topic for a captured table: PREFIX.SCHEMA.TABLE, a character Kafka refuses as '_'.
CREATE FUNCTION outbox_capture_topic(topic_prefix text, table_schema text, table_name text) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN topic_prefix || '.' || regexp_replace(table_schema || '.' || table_name, '[^A-Za-z0-9._-]', '_', 'g');

-- An event's value, but for its before (b), after (a) and op (o): the text before the op and the text
-- after it. Debezium's envelope, field for field in its order. What postbox cannot know at write time is
-- null (sequence, lsn, xmin, origin); the times are this statement's (source.ts_*: Debezium's is the
-- commit's) and txId is the writing transaction's 32-bit id, as Debezium's.
CREATE FUNCTION outbox_capture_source(source_version text, topic_prefix text, table_schema text,
                                      table_name text, snapshot text) RETURNS text[]
    LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    micros numeric := trunc(extract(epoch FROM clock_timestamp()) * 1000000);
    stamp text := format('"ts_us":%s,"ts_ns":%s', micros, micros * 1000);
BEGIN
    RETURN ARRAY[
        format(',"source":{"version":%s,"connector":"postgresql","name":%s,"ts_ms":%s,"snapshot":%s,'
               '"db":%s,"sequence":null,%s,"schema":%s,"table":%s,"txId":%s,"lsn":null,"xmin":null,'
               '"origin":null,"origin_lsn":null},"transaction":null,"op":"',
               outbox_capture_json_string(source_version),
               outbox_capture_json_string(topic_prefix), div(micros, 1000),
               outbox_capture_json_string(snapshot), outbox_capture_json_string(current_database()),
               stamp, outbox_capture_json_string(table_schema), outbox_capture_json_string(table_name),
               pg_current_xact_id()::text::bigint % 4294967296),
        format('","ts_ms":%s,%s}', div(micros, 1000), stamp)];
END;
$$;

-- The SQL expression of an event's value as bytes, from columns b, a and o and the two texts of
-- outbox_capture_source (`before_op`, `after_op`: SQL that names them, a parameter or a variable).
CREATE FUNCTION outbox_capture_envelope_sql(before_op text, after_op text) RETURNS text
    LANGUAGE sql IMMUTABLE
    RETURN format('convert_to(''{"before":'' || coalesce(b, ''null'') || '',"after":'' || coalesce(a, ''null'') '
                  '|| %s || o || %s, ''UTF8'')', before_op, after_op);

-- What a table's trigger function was made for, as far as the table can change under it: its columns
-- (names, types, order) and its primary key. Checked at every statement, from the catalog's caches. (A
-- capture's own settings change only through capture_add, which makes the function again.)
CREATE FUNCTION outbox_capture_shape(captured regclass) RETURNS text
    LANGUAGE sql STABLE
    RETURN (SELECT string_agg(format('%s:%s:%s:%s', a.attname, a.atttypid, a.atttypmod, a.attgenerated), ','
                              ORDER BY a.attnum)
            FROM pg_attribute AS a WHERE a.attrelid = captured AND a.attnum > 0 AND NOT a.attisdropped)
           || '|' || coalesce((SELECT i.indkey::text FROM pg_index AS i WHERE i.indrelid = captured AND i.indisprimary), '');

-- The INSERT into the outbox that one statement's changed rows make, in the order the statement changed
-- them. refs: SQL naming the aggregate type, topic, tombstones flag, and outbox_capture_source's two texts.
-- INSERT: a create (c) per row. DELETE: a delete (d), then a tombstone (a null value with the same key,
-- so compaction can drop the key), per row. UPDATE: an update (u) per row, even one that changes nothing
-- (Debezium sends those too); a row whose key changed is a delete and a tombstone of the old key, then a
-- create of the new, with Debezium's __debezium.newkey / __debezium.oldkey headers. The old and new
-- transition tables list an UPDATE's rows in the same order, so rows pair by position, whatever the key
-- does (a table keyed by --key-columns may repeat a key). `before` is always the whole old row: Debezium's
-- REPLICA IDENTITY FULL (see the docs). TRUNCATE is not captured (Debezium's default skips it).
CREATE FUNCTION outbox_capture_statement_sql(capture outbox_capture, operation text, refs text[]) RETURNS text
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    envelope text := outbox_capture_envelope_sql(refs[4], refs[5]);
    gone text;
BEGIN
    -- Fail closed: a key that is gone would make every row one key ({}), and an excluded column renamed
    -- would be published. The writer's statement fails with the reason until the capture is added again.
    SELECT string_agg(quote_ident(name), ', ') INTO gone
    FROM unnest(coalesce(capture.key_columns, '{}') || coalesce(capture.exclude_columns, '{}')) AS name
    WHERE NOT EXISTS (SELECT FROM pg_attribute AS a WHERE a.attrelid = capture.table_id AND a.attname = name
                      AND a.attnum > 0 AND NOT a.attisdropped);
    IF gone IS NOT NULL OR NOT EXISTS (SELECT FROM outbox_capture_key_columns(capture)) THEN
        RAISE EXCEPTION 'postbox capture: %: %', capture.table_id,
            coalesce('the capture names columns it no longer has: ' || gone, 'it has no primary key any more')
            USING ERRCODE = '55000',
                  HINT = 'postbox capture add it again with its current columns (--key-columns, --exclude-columns)';
    END IF;
    IF operation = 'INSERT' THEN
        RETURN format('INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload_bytes, topic) '
                      'SELECT %s, k, o, %s, %s FROM (SELECT %s AS k, %s AS a, NULL::text AS b, ''c'' AS o '
                      'FROM postbox_new AS n) AS r',
                      refs[1], envelope, refs[2], outbox_capture_object_sql(capture, 'n', true),
                      outbox_capture_object_sql(capture, 'n', false));
    ELSIF operation = 'DELETE' THEN
        RETURN format('INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload_bytes, topic) '
                      'SELECT %s, r.k, e.o, CASE WHEN e.o = ''d'' THEN %s END, %s '
                      'FROM (SELECT row_number() OVER () AS position, %s AS k, %s AS b, NULL::text AS a '
                      '      FROM postbox_old AS o) AS r '
                      'CROSS JOIN LATERAL (VALUES (1, ''d''), (2, ''tombstone'')) AS e(step, o) '
                      'WHERE e.step = 1 OR %s ORDER BY r.position, e.step',
                      refs[1], envelope, refs[2], outbox_capture_object_sql(capture, 'o', true),
                      outbox_capture_object_sql(capture, 'o', false), refs[3]);
    END IF;
    RETURN format('INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload_bytes, headers, topic) '
                  'SELECT %s, e.k, e.o, CASE WHEN e.o <> ''tombstone'' THEN %s END, e.h, %s '
                  'FROM (SELECT row_number() OVER () AS position, %s AS k, %s AS doc FROM postbox_old AS o) AS ov '
                  'JOIN (SELECT row_number() OVER () AS position, %s AS k, %s AS doc FROM postbox_new AS n) AS nv '
                  '  USING (position) '
                  'CROSS JOIN LATERAL (VALUES '
                  '  (1, CASE WHEN ov.k = nv.k THEN ''u'' ELSE ''d'' END, ov.k, ov.doc, '
                  '   CASE WHEN ov.k = nv.k THEN nv.doc END, '
                  '   CASE WHEN ov.k = nv.k THEN ''{}''::jsonb ELSE jsonb_build_object(''__debezium.newkey'', nv.k) END), '
                  '  (2, ''tombstone'', ov.k, NULL, NULL, jsonb_build_object(''__debezium.newkey'', nv.k)), '
                  '  (3, ''c'', nv.k, NULL, nv.doc, jsonb_build_object(''__debezium.oldkey'', ov.k)) '
                  ') AS e(step, o, k, b, a, h) '
                  'WHERE e.step = 1 OR (ov.k <> nv.k AND (e.step = 3 OR %s)) '
                  'ORDER BY position, e.step',
                  refs[1], envelope, refs[2], outbox_capture_object_sql(capture, 'o', true),
                  outbox_capture_object_sql(capture, 'o', false), outbox_capture_object_sql(capture, 'n', true),
                  outbox_capture_object_sql(capture, 'n', false), refs[3]);
END;
$$;

-- (Re)makes a captured table's trigger function, outbox_capture_<table oid>: the three statements of
-- outbox_capture_statement_sql written into it, so PostgreSQL plans them once per session, not at every
-- statement. Its first step compares the table's shape with the one it was made for; a table changed
-- since (ALTER TABLE ... ADD/DROP/ALTER COLUMN, or a capture's settings) renders that statement from the
-- catalog and makes the function again for the next (if no other session is doing so at that moment).
-- SECURITY DEFINER: a writer of the table needs no right on the outbox. The SQL it holds comes from the
-- catalog with every name quoted; the dollar quote around it is drawn at random and checked absent.
CREATE FUNCTION outbox_capture_make_function(captured regclass) RETURNS regprocedure
    LANGUAGE plpgsql AS $$
DECLARE
    capture outbox_capture;
    name text;
    quote text := '$pbx' || substr(md5(random()::text || clock_timestamp()::text), 1, 12) || '$';
    refs constant text[] := ARRAY['v_type', 'v_topic', 'v_tombstones', 'v_texts[1]', 'v_texts[2]'];
    body text;
BEGIN
    SELECT * INTO STRICT capture FROM outbox_capture WHERE table_id = captured;
    name := coalesce(capture.trigger_function, 'outbox_capture_' || captured::oid);
    -- The capture's settings are written into the function (capture_add makes it again when they change).
    body := format($template$
DECLARE
    v_type text := TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
    v_topic text := outbox_capture_topic(%1$L, TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_tombstones constant boolean := %2$L;
    v_texts text[] := outbox_capture_source(%3$L, %1$L, TG_TABLE_SCHEMA, TG_TABLE_NAME, 'false');
    capture outbox_capture;
BEGIN
    IF outbox_capture_shape(TG_RELID) IS DISTINCT FROM %4$L THEN
        -- The table changed since this function was made: this statement from the catalog, and the
        -- function made again for the next (unless another session is making it now).
        SELECT * INTO STRICT capture FROM outbox_capture WHERE table_id = TG_RELID;
        IF pg_try_advisory_xact_lock(%5$s, (TG_RELID::bigint - 2147483648)::integer)
           AND EXISTS (SELECT FROM outbox_capture WHERE table_id = TG_RELID FOR UPDATE SKIP LOCKED) THEN
            PERFORM outbox_capture_make_function(TG_RELID);
        END IF;
        EXECUTE outbox_capture_statement_sql(capture, TG_OP, ARRAY['$1', '$2', '$3', '$4', '$5'])
            USING v_type, v_topic, v_tombstones, v_texts[1], v_texts[2];
    ELSIF TG_OP = 'INSERT' THEN
        %6$s;
    ELSIF TG_OP = 'DELETE' THEN
        %7$s;
    ELSE
        %8$s;
    END IF;
    RETURN NULL;
END;
$template$, capture.topic_prefix, coalesce((capture.options ->> 'tombstones.on.delete')::boolean, true),
                   capture.source_version, outbox_capture_shape(captured),
                   hashtext('postbox capture'),
                   outbox_capture_statement_sql(capture, 'INSERT', refs),
                   outbox_capture_statement_sql(capture, 'DELETE', refs),
                   outbox_capture_statement_sql(capture, 'UPDATE', refs));
    IF position(quote IN body) > 0 THEN
        RAISE EXCEPTION 'postbox capture: the quote % turned up in the function body of %', quote, captured;
    END IF;
    -- extra_float_digits: floats render from their shortest text; the others: the text of any type rendered
    -- as its text (a range of timestamptz, a composite holding bytea) is the same whatever the writer's
    -- session, and the same as the snapshot's.
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.%I() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                   'SET extra_float_digits = 1 SET "TimeZone" = ''UTC'' SET "DateStyle" = ''ISO, YMD'' '
                   'SET "IntervalStyle" = ''postgres'' SET bytea_output = ''hex'' '
                   'SET search_path = %I, pg_temp AS %s%s%s', current_schema(), name, current_schema(), quote, body,
                   quote);
    -- Only its owner may attach it to a table (EXECUTE is checked by CREATE TRIGGER): it renders this
    -- table's columns, and writes to the outbox with its owner's rights.
    EXECUTE format('REVOKE ALL ON FUNCTION %I.%I() FROM PUBLIC', current_schema(), name);
    UPDATE outbox_capture SET trigger_function = name
    WHERE table_id = captured AND trigger_function IS DISTINCT FROM name;
    RETURN format('%I.%I()', current_schema(), name)::regprocedure;
END;
$$;

-- Options, by Debezium's names, with the values this capture renders.
CREATE FUNCTION outbox_capture_check_options(options jsonb) RETURNS void
    LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    allowed constant jsonb := '{"tombstones.on.delete": ["true", "false"],
                                "decimal.handling.mode": ["precise", "double", "string"],
                                "time.precision.mode": ["adaptive", "adaptive_time_microseconds", "connect"]}';
    option record;
BEGIN
    IF options IS NULL OR jsonb_typeof(options) <> 'object' THEN
        RAISE EXCEPTION 'postbox capture: options must be a JSON object' USING ERRCODE = '22023';
    END IF;
    FOR option IN SELECT key, value FROM jsonb_each(options) LOOP
        IF NOT allowed ? option.key THEN
            RAISE EXCEPTION 'postbox capture: unknown option %', option.key USING ERRCODE = '22023',
                HINT = 'known options: ' || (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(allowed) AS k);
        END IF;
        IF jsonb_typeof(option.value) NOT IN ('string', 'boolean')
           OR NOT (allowed -> option.key) ? (option.value #>> '{}') THEN
            RAISE EXCEPTION 'postbox capture: option % must be one of %, not %', option.key,
                allowed -> option.key, option.value USING ERRCODE = '22023';
        END IF;
    END LOOP;
END;
$$;

-- `postbox capture add`, as SQL for teams that migrate with their own tool:
--     SELECT postbox.capture_add('app.orders');
--     SELECT postbox.capture_add('app.orders', topic_prefix => 'shop', exclude_columns => '{card_number}');
-- Idempotent: adding again changes the settings (the triggers are re-created, in this transaction).
-- Run as the table's owner (or a role with TRIGGER on it) that may write outbox_capture. Returns the topic.
CREATE FUNCTION capture_add(captured regclass, topic_prefix text DEFAULT 'postbox', columns text[] DEFAULT NULL,
                            exclude_columns text[] DEFAULT NULL, key_columns text[] DEFAULT NULL,
                            options jsonb DEFAULT '{}', source_version text DEFAULT 'postbox')
    RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    relation pg_class;
    capture outbox_capture;
    before outbox_capture;
    missing text;
    topic text;
    function regprocedure;
BEGIN
    IF captured IS NULL THEN
        RAISE EXCEPTION 'postbox capture: name the table to capture' USING ERRCODE = '22004';
    END IF;
    SELECT * INTO relation FROM pg_class WHERE oid = captured;
    IF relation.relkind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'postbox capture: % is not a table', captured USING ERRCODE = '42809';
    END IF;
    IF relation.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) THEN
        RAISE EXCEPTION 'postbox capture: % is one of postbox''s own tables', captured USING ERRCODE = '42809';
    END IF;
    -- A statement's triggers fire on the table it names: rows written through a partition or an
    -- inheritance child would not be seen by the parent's capture, nor the parent's by a child's.
    IF relation.relkind = 'p' OR relation.relispartition
       OR EXISTS (SELECT FROM pg_inherits WHERE inhrelid = captured OR inhparent = captured) THEN
        RAISE EXCEPTION 'postbox capture: % is partitioned, a partition, or in an inheritance tree, which a '
                        'capture does not follow yet', captured USING ERRCODE = '0A000';
    END IF;
    IF relation.relpersistence = 't' THEN
        RAISE EXCEPTION 'postbox capture: % is a temporary table', captured USING ERRCODE = '42809';
    END IF;
    IF topic_prefix IS NULL OR topic_prefix !~ '^[A-Za-z0-9._-]+$' THEN
        RAISE EXCEPTION 'postbox capture: the topic prefix % may hold only letters, digits, ".", "_" and "-"',
            coalesce(topic_prefix, 'NULL') USING ERRCODE = '22023';
    END IF;
    IF columns IS NOT NULL AND exclude_columns IS NOT NULL THEN
        RAISE EXCEPTION 'postbox capture: name the columns to capture or those to leave out, not both'
            USING ERRCODE = '22023';
    END IF;
    IF cardinality(key_columns) = 0 OR cardinality(columns) = 0 THEN
        RAISE EXCEPTION 'postbox capture: an empty list of columns: leave it out instead' USING ERRCODE = '22023';
    END IF;
    IF key_columns IS NOT NULL AND cardinality(key_columns) <> (SELECT count(DISTINCT k) FROM unnest(key_columns) AS k) THEN
        RAISE EXCEPTION 'postbox capture: a key column is named twice' USING ERRCODE = '22023';
    END IF;
    SELECT string_agg(coalesce(quote_ident(name), 'NULL'), ', ') INTO missing
    FROM unnest(coalesce(columns, '{}') || coalesce(exclude_columns, '{}') || coalesce(key_columns, '{}')) AS name
    WHERE name IS NULL OR NOT EXISTS (SELECT FROM pg_attribute AS a WHERE a.attrelid = captured
                                      AND a.attname = name AND a.attnum > 0 AND NOT a.attisdropped);
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'postbox capture: % has no column %', captured, missing USING ERRCODE = '42703';
    END IF;
    PERFORM outbox_capture_check_options(options);
    -- Writers wait while the capture is installed (the lock lets readers on), so no statement is written
    -- half before and half after; and one capture_add, or a writer remaking the function, at a time.
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', captured);
    PERFORM pg_advisory_xact_lock(hashtext('postbox capture'), (captured::oid::bigint - 2147483648)::integer);
    capture := ROW(captured, topic_prefix, columns, exclude_columns, key_columns, options,
                   coalesce(source_version, 'postbox'), now(), NULL, NULL, NULL, NULL);
    IF NOT EXISTS (SELECT FROM outbox_capture_key_columns(capture)) THEN
        RAISE EXCEPTION 'postbox capture: % has no primary key', captured USING ERRCODE = '42P10',
            HINT = 'name the columns that identify a row: --key-columns (key_columns => ''{...}'')';
    END IF;
    topic := outbox_capture_topic(topic_prefix, (SELECT nspname FROM pg_namespace WHERE oid = relation.relnamespace),
                                  relation.relname);
    IF length(topic) > 249 THEN
        RAISE EXCEPTION 'postbox capture: the topic % is longer than Kafka''s 249 characters', topic
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO before FROM outbox_capture WHERE table_id = captured FOR UPDATE;
    INSERT INTO outbox_capture AS c (table_id, topic_prefix, columns, exclude_columns, key_columns, options,
                                     source_version)
    VALUES (captured, topic_prefix, columns, exclude_columns, key_columns, options, capture.source_version)
    ON CONFLICT (table_id) DO UPDATE
        SET topic_prefix = EXCLUDED.topic_prefix, columns = EXCLUDED.columns,
            exclude_columns = EXCLUDED.exclude_columns, key_columns = EXCLUDED.key_columns,
            options = EXCLUDED.options, source_version = EXCLUDED.source_version;
    -- A snapshot's position is a key: another key, or a table that was not being captured (a registration
    -- left by a dropped table whose oid came back), starts the snapshot again.
    IF before.key_columns IS DISTINCT FROM key_columns
       OR NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = captured AND tgname = 'postbox_capture_insert') THEN
        UPDATE outbox_capture SET snapshot_after = NULL, snapshot_started_at = NULL, snapshot_done_at = NULL
        WHERE table_id = captured;
    END IF;
    function := outbox_capture_make_function(captured);
    -- CREATE OR REPLACE TRIGGER: a lock that lets readers on (DROP TRIGGER would shut them out).
    EXECUTE format('CREATE OR REPLACE TRIGGER postbox_capture_insert AFTER INSERT ON %1$s '
                   'REFERENCING NEW TABLE AS postbox_new FOR EACH STATEMENT EXECUTE FUNCTION %2$s; '
                   'CREATE OR REPLACE TRIGGER postbox_capture_update AFTER UPDATE ON %1$s '
                   'REFERENCING OLD TABLE AS postbox_old NEW TABLE AS postbox_new FOR EACH STATEMENT EXECUTE FUNCTION %2$s; '
                   'CREATE OR REPLACE TRIGGER postbox_capture_delete AFTER DELETE ON %1$s '
                   'REFERENCING OLD TABLE AS postbox_old FOR EACH STATEMENT EXECUTE FUNCTION %2$s',
                   captured, function);
    RETURN topic;
END;
$$;

-- `postbox capture remove`: the triggers and the registration, in the caller's transaction. Events already
-- written stay in the outbox and are published. False when the table was not captured.
CREATE FUNCTION capture_remove(captured regclass) RETURNS boolean
    LANGUAGE plpgsql AS $$
BEGIN
    IF captured IS NULL THEN
        RAISE EXCEPTION 'postbox capture: name the table to stop capturing' USING ERRCODE = '22004';
    END IF;
    EXECUTE format('DROP TRIGGER IF EXISTS postbox_capture_insert ON %1$s; '
                   'DROP TRIGGER IF EXISTS postbox_capture_update ON %1$s; '
                   'DROP TRIGGER IF EXISTS postbox_capture_delete ON %1$s; '
                   'DROP FUNCTION IF EXISTS %2$I.%3$I()', captured, current_schema(),
                   coalesce((SELECT trigger_function FROM outbox_capture WHERE table_id = captured),
                            'outbox_capture_' || captured::oid));
    DELETE FROM outbox_capture WHERE table_id = captured;
    RETURN FOUND;
END;
$$;

-- `postbox capture list`.
CREATE VIEW outbox_captures AS
SELECT c.table_id::text AS captured_table, outbox_capture_topic(c.topic_prefix, n.nspname, t.relname) AS topic,
       (SELECT array_agg(k.name) FROM outbox_capture_key_columns(c) AS k) AS key_columns,
       c.columns, c.exclude_columns, c.options, c.added_at,
       CASE WHEN c.snapshot_done_at IS NOT NULL THEN 'done'
            WHEN c.snapshot_started_at IS NOT NULL THEN 'in progress'
            ELSE 'none' END AS snapshot,
       c.snapshot_done_at
FROM outbox_capture AS c
JOIN pg_class AS t ON t.oid = c.table_id
JOIN pg_namespace AS n ON n.oid = t.relnamespace;

-- One chunk of `postbox capture snapshot`: the next `chunk_rows` rows after the last one emitted, in key
-- order, each as a read event (op r, snapshot "true"), and the position, in the caller's transaction.
-- Returns how many; 0 when the snapshot is done. The chunk's end is read first, without a lock; then the
-- rows up to it are locked FOR SHARE until the caller commits: a writer that changes one of them waits, so
-- its change event commits after the read event, and a writer that changed one first has committed (its
-- event is earlier in commit order) before the chunk reads the row's newest version. A row whose key a
-- writer moves past the chunk's end is read by a later chunk, or not at all, but its move is an event of
-- its own. So, per key, what a consumer sees never goes back in time. Restart with restart => true.
CREATE FUNCTION capture_snapshot_chunk(captured regclass, chunk_rows integer DEFAULT 1000,
                                       restart boolean DEFAULT false) RETURNS integer
    LANGUAGE plpgsql
    SET extra_float_digits = 1 SET "TimeZone" = 'UTC' SET "DateStyle" = 'ISO, YMD'
    SET "IntervalStyle" = 'postgres' SET bytea_output = 'hex' AS $$
DECLARE
    capture outbox_capture;
    keys text;         -- "a", "b"
    as_text text;      -- ARRAY[outbox_capture_text(s."a"), ...]: by the types' output functions
    after_clause text := '';
    bound text[];      -- the chunk's last key (NULL: the rest of the table is the last chunk)
    bound_clause text := '';
    emitted integer;
    relation record;
    texts text[];
BEGIN
    IF captured IS NULL OR chunk_rows IS NULL OR chunk_rows < 1 THEN
        RAISE EXCEPTION 'postbox capture: a snapshot needs a table and a chunk of at least one row'
            USING ERRCODE = '22023';
    END IF;
    -- One snapshot of a table at a time: a second caller waits here for the first's chunk.
    SELECT * INTO capture FROM outbox_capture WHERE table_id = captured FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'postbox capture: % is not captured', captured USING ERRCODE = '55000',
            HINT = 'postbox capture add first: changes made after the snapshot begins must be captured too';
    END IF;
    IF restart THEN
        capture.snapshot_after := NULL;
        capture.snapshot_done_at := NULL;
        capture.snapshot_started_at := NULL;
    END IF;
    IF capture.snapshot_done_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    -- Reads in key order: the key must be unique and never NULL (a NULL position would end it early).
    IF NOT EXISTS (
        SELECT FROM pg_index AS i
        WHERE i.indrelid = captured AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
          AND i.indexprs IS NULL
          AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute AS a
               WHERE a.attrelid = captured AND a.attnum = ANY (i.indkey))
              <@ (SELECT array_agg(k.name) FROM outbox_capture_key_columns(capture) AS k))
       OR EXISTS (SELECT FROM outbox_capture_key_columns(capture) AS k
                  JOIN pg_attribute AS a ON a.attrelid = captured AND a.attname = k.name
                  WHERE NOT a.attnotnull) THEN
        RAISE EXCEPTION 'postbox capture: the snapshot of % reads in key order and needs a unique key that is '
                        'never null', captured
            USING ERRCODE = '42P10', HINT = 'a primary key, or a unique index on NOT NULL --key-columns';
    END IF;
    SELECT string_agg(format('s.%I', k.name), ', ' ORDER BY k.ord),
           format('ARRAY[%s]', string_agg(format('outbox_capture_text(s.%I)', k.name), ', ' ORDER BY k.ord))
      INTO keys, as_text
    FROM outbox_capture_key_columns(capture) WITH ORDINALITY AS k(name, type_id, typmod, ord);
    -- A position back to its key: literals, read by the types' input functions (never a cast).
    IF capture.snapshot_after IS NOT NULL THEN
        SELECT format('WHERE (%s) > (%s)', keys,
                      string_agg(format('%L::%s', capture.snapshot_after[k.ord], format_type(k.type_id, k.typmod)),
                                 ', ' ORDER BY k.ord))
          INTO after_clause
        FROM outbox_capture_key_columns(capture) WITH ORDINALITY AS k(name, type_id, typmod, ord);
    END IF;
    EXECUTE format('SELECT %s FROM %s AS s %s ORDER BY %s OFFSET %s LIMIT 1', as_text, captured, after_clause,
                   keys, chunk_rows - 1)
        INTO bound;
    IF bound IS NOT NULL THEN
        SELECT format('%s (%s) <= (%s)', CASE WHEN after_clause = '' THEN 'WHERE' ELSE 'AND' END, keys,
                      string_agg(format('%L::%s', bound[k.ord], format_type(k.type_id, k.typmod)),
                                 ', ' ORDER BY k.ord))
          INTO bound_clause
        FROM outbox_capture_key_columns(capture) WITH ORDINALITY AS k(name, type_id, typmod, ord);
    END IF;
    SELECT n.nspname, c.relname INTO relation
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE c.oid = captured;
    texts := outbox_capture_source(capture.source_version, capture.topic_prefix, relation.nspname,
                                   relation.relname, 'true');
    EXECUTE format(
        'WITH chunk AS (SELECT * FROM %1$s AS s %2$s %3$s ORDER BY %4$s FOR SHARE), '
        'written AS (INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload_bytes, topic) '
        '  SELECT $1, k, o, %5$s, $2 FROM (SELECT %6$s AS k, %7$s AS a, NULL::text AS b, ''r'' AS o, '
        '    row_number() OVER (ORDER BY %4$s) AS ord FROM chunk AS s) AS r ORDER BY ord) '
        'SELECT count(*) FROM chunk',
        captured, after_clause, bound_clause, keys,
        outbox_capture_envelope_sql('$3', '$4'),
        outbox_capture_object_sql(capture, 's', true), outbox_capture_object_sql(capture, 's', false))
        INTO emitted
        USING relation.nspname || '.' || relation.relname,
              outbox_capture_topic(capture.topic_prefix, relation.nspname, relation.relname),
              texts[1], texts[2];
    UPDATE outbox_capture
    SET snapshot_after = coalesce(bound, capture.snapshot_after),
        snapshot_started_at = coalesce(capture.snapshot_started_at, now()),
        snapshot_done_at = CASE WHEN bound IS NULL THEN now() END
    WHERE table_id = captured;
    -- (The last chunk, unbounded, may hold chunk_rows rows or more, written since its end was looked for:
    -- a caller that goes on until a count below chunk_rows then gets 0, the snapshot being done.)
    RETURN emitted;
END;
$$;

-- Every function works on this schema's outbox, whatever the caller's search_path; the capture trigger
-- (SECURITY DEFINER) must never resolve a name through a caller's schemas. (Functions with a SQL-standard
-- body bind their names when created, and keep no setting, so PostgreSQL can inline them.)
DO $fix$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc AS p
             WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND p.prosqlbody IS NULL
               AND (p.proname LIKE 'outbox\_capture\_%' OR p.proname LIKE 'capture\_%')
               AND p.proname <> 'outbox_capture_text' LOOP  -- names pg_catalog's concat itself; inlined
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
    END LOOP;
END
$fix$;
