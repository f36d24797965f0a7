"""Change-data capture: the changes of business tables as Debezium-format events, through the outbox.

The work is done by SQL (migration 0012): a trigger renders each statement's changed rows and writes them
to the outbox in the writer's transaction, and the relay publishes them like any event. This package is
the operator's side: `postbox capture add | list | remove | snapshot` (relay.capture.cli), each a call of
the SQL function of the same name (relay.capture.admin), for teams that run migrations with their own tool.
"""
