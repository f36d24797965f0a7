-- The outbox's identity: a random id made once, with the outbox. Exactly-once publication (`postbox relay
-- run --exactly-once`) names its transactional ids and its cursor topic after it by default, and every
-- settlement it writes to Kafka carries it, so that two outboxes on one Kafka cluster never read each
-- other's. A dump restored elsewhere keeps it: the same outbox, moved (its cursor table's oid, which a
-- settlement carries too, tells the copies apart).
CREATE TABLE outbox_identity (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    outbox_id  uuid NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_identity DEFAULT VALUES;
