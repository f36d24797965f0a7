"""What the tests share, a module per job; import each name from the module that holds it (nothing is
re-exported here):

- servers: Servers, where the tests find PostgreSQL and Kafka (provide_servers, the `servers` fixture's);
- repo: REPO, the root of the checkout;
- waiting: wait_until (a condition met in time) and holds_for (one that holds throughout a period);
- probes: http_get and metric_value, a running process's HTTP answers and metrics;
- processes: postbox as child processes (ChildProcess, RelayProcess, InboxProcess, WorkerProcess,
  ReceiverProcess), followed_modes, inbox_cli;
- kafka: create_topic, produce, produce_with_headers, read_topic and its Record;
- database: prepare_outbox, outbox_states, written_state, newest_tick, shard_owners, execute_script;
- modes: BOTH_MODES, QUEUE_ONLY and LOG_ONLY, the `relay_mode` fixture's parametrizations (log by default);
- delivery: write_sequenced and check_delivery, the relay's ordering promise written and judged;
- webhooks: the receiver's signing secrets, a signed Stripe event (stripe_body, stripe_headers), and what
  tests.apps.hooks did (wait_settled, applied);
- bank: deposits for tests.apps.bank and its effects.
"""
