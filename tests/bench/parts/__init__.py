"""tests.bench.run's parts, one module each, by the name `--only` takes: limits, drain, latency, longtx,
tracing, consumers, webhooks, capture, exactly_once. Each has the functions that measure and a run_part
that prints its lines."""
