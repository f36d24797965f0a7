-- Log mode's window bounds read two index entries per transaction instead of every row of the window.
--
-- Opening a window needs the lowest and highest id of its rows in a lane's shards. With the index on
-- (txid) alone that meant fetching every row of the window: a backlog of 1,000,000 rows written in one
-- transaction cost each lane about 2.7 s before its first page (measured on the drain benchmark, 203
-- window openings took 5.4 s of server time). On (txid, id) the bounds are found per transaction: the
-- window's transactions by a skip scan over txid, then each one's lowest and highest id in the lane's
-- shards from the ends of its own entries (queries.sql, log_window_bounds).
--
-- The index on (txid, id) serves every lookup by txid the old one served, so it replaces it. Building it
-- holds writers back while it reads the logged rows of every partition: on a large outbox, run this
-- migration at a quiet time.

DROP INDEX outbox_log_idx;
CREATE INDEX outbox_log_idx ON outbox (txid, id) WHERE state = 'logged';
