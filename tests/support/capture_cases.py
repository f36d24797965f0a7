"""A captured table with a column of every common type, and the statements that change it: what the
capture is compared with Debezium on (tests/integration/test_capture_debezium.py), byte for byte.

Each statement is listed with the change events Debezium sends for it (TRUNCATE: none, Debezium's
default; an UPDATE of the primary key: a delete, a tombstone and a create)."""

from __future__ import annotations

TABLE = "things"

# REPLICA IDENTITY FULL: Debezium then sends the whole old row in `before`, as postbox's trigger always
# does (the docs say so); with the default identity Debezium's `before` is null on updates.
SCHEMA_SQL = """
CREATE TYPE {app}.mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE {app}.things (
  id bigint PRIMARY KEY,
  c_small smallint, c_int integer, c_big bigint,
  c_num numeric(12,3), c_num_free numeric, c_real real, c_double double precision,
  c_text text, c_varchar varchar(20), c_char char(3), c_bool boolean, c_uuid uuid,
  c_json json, c_jsonb jsonb, c_bytea bytea,
  c_date date, c_time time, c_time3 time(3), c_timetz timetz,
  c_ts timestamp, c_ts0 timestamp(0), c_ts3 timestamp(3), c_tstz timestamptz, c_tstz3 timestamptz(3),
  c_int_arr integer[], c_text_arr text[], c_mood {app}.mood, c_interval interval, c_money money,
  c_serial serial, c_inet inet, c_bigtext text
);
ALTER TABLE {app}.things REPLICA IDENTITY FULL;
"""

# (statement, events Debezium sends for it)
CHANGES: list[tuple[str, int]] = [
    ("SET TIME ZONE 'Europe/Berlin'", 0),  # rendering must not depend on the writer's session
    ("INSERT INTO {app}.things (id) VALUES (1)", 1),
    (
        "INSERT INTO {app}.things VALUES (2, -32768, 2147483647, 9223372036854775807, 123456789.125, "
        "3.14159265358979323846, 1.5, 0.1, "
        "E'caf\\u00e9 \"q\" \\\\ \\t\\n\\x01\\x1b \\U0001F600', 'vc', 'ab', true, "
        "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', "
        '\'{{"b": 1,  "a":[1,2]}}\', \'{{"b": 1,  "a":[1,2]}}\', '
        "'\\x00ff10', '2024-02-29', '13:45:12.123456', '13:45:12.1239', '13:45:12+02', "
        "'2024-02-29 13:45:12.123456', '2024-02-29 13:45:12.6', '2024-02-29 13:45:12.1239', "
        "'2024-02-29 13:45:12.123456+02', '2024-02-29 13:45:12.1+02', "
        "'{{1,NULL,3}}', '{{\"a\",\"b c\",NULL}}', "
        "'happy', '1 year 2 mons 3 days 04:05:06.7', 12.34, DEFAULT, '10.0.0.1/8', repeat('x', 100000))",
        1,
    ),
    (
        "INSERT INTO {app}.things (id, c_num, c_num_free, c_real, c_double, c_ts, c_tstz, c_date, c_time) "
        "VALUES (3, -0.001, -12345678901234567890.000100, 1e20, 1e-5, '1969-12-31 23:59:59.999999', "
        "'1900-01-01 00:00:00+00', '1900-01-01', '00:00:00')",
        1,
    ),
    (
        "INSERT INTO {app}.things (id, c_num, c_num_free, c_real, c_double, c_tstz) "
        "VALUES (4, 0, 0, 100, 1e7, '2024-01-01 00:00:00Z')",
        1,
    ),
    ("INSERT INTO {app}.things (id, c_num_free, c_real, c_double) VALUES (5, 1e30, 123456.7, 123.0)", 1),
    ("INSERT INTO {app}.things (id, c_num_free, c_double) VALUES (6, 'NaN', 'Infinity')", 1),
    (
        "INSERT INTO {app}.things (id, c_num, c_num_free, c_double) VALUES (11, 'NaN', '-Infinity', 'NaN')",
        1,
    ),
    ("INSERT INTO {app}.things (id, c_double, c_real) VALUES (7, 1234567.0, 0.001), (8, 0.0001, -0.0)", 2),
    ("INSERT INTO {app}.things (id, c_double, c_real, c_text_arr) VALUES (9, -2.5e-300, 3.4e38, '{{}}')", 1),
    ("UPDATE {app}.things SET c_text = 'changed' WHERE id = 2", 1),
    ("UPDATE {app}.things SET c_int = c_int WHERE id = 1", 1),  # changes nothing: still an update
    ("UPDATE {app}.things SET id = 10 WHERE id = 3", 3),  # key change: delete, tombstone, create
    ("DELETE FROM {app}.things WHERE id = 4", 2),  # delete, tombstone
    ("BEGIN", 0),
    ("INSERT INTO {app}.things (id) VALUES (20)", 0),
    ("ROLLBACK", 0),
    ("BEGIN", 0),
    ("INSERT INTO {app}.things (id) VALUES (21)", 1),
    ("SAVEPOINT s1", 0),
    ("INSERT INTO {app}.things (id) VALUES (22)", 0),
    ("ROLLBACK TO SAVEPOINT s1", 0),
    ("INSERT INTO {app}.things (id) VALUES (23)", 1),
    ("COMMIT", 0),
    ("ALTER TABLE {app}.things ADD COLUMN c_new integer DEFAULT 7", 0),
    ("INSERT INTO {app}.things (id) VALUES (30)", 1),
    ("ALTER TABLE {app}.things DROP COLUMN c_small", 0),
    ("UPDATE {app}.things SET c_new = 8 WHERE id = 30", 1),
    ("UPDATE {app}.things SET c_bigtext = c_bigtext || 'y' WHERE id = 2", 1),  # a TOASTed value, whole
    ("TRUNCATE {app}.things", 0),
    ("INSERT INTO {app}.things (id) VALUES (40)", 1),
]

EVENTS = sum(events for _, events in CHANGES)


def run_changes(conn: object, app: str) -> None:
    """Every statement of CHANGES on an autocommit connection, in order."""
    for statement, _ in CHANGES:
        conn.execute(statement.format(app=app))  # type: ignore[attr-defined]
