-- The relay's claim reads the pending rows of some shards in id order. With the shard beside the id in
-- the index, the shard filter is checked on the index entry itself, so rows of other replicas' shards cost
-- an index entry each instead of a heap fetch. The claim orders by (id, shard) and its connections run with
-- sorts disabled, so this index is the only sort-free path and the plan stays the same whatever the
-- table's statistics say (relay/outbox/queries.sql, claim_batch).
-- The build scans the outbox and blocks writes to it meanwhile: prune published rows first on a large one.
DROP INDEX outbox_pending_idx;
CREATE INDEX outbox_pending_idx ON outbox (id, shard) WHERE state = 'pending';
