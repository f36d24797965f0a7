"""The relay's Prometheus metrics, registered on a registry the caller creates (no import-time globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "postbox_relay_published_total", "Outbox rows published to Kafka", ["topic"], registry=registry
        )
        self.parked = Counter(
            "postbox_relay_parked_total",
            "Outbox rows parked as failed (permanent error)",
            ["topic"],
            registry=registry,
        )
        self.retried = Counter(
            "postbox_relay_retried_total",
            "Outbox rows left pending after a transient failure",
            registry=registry,
        )
        self.fenced = Counter(
            "postbox_relay_mark_fenced_total",
            "Delivered rows not marked because their shard lease was lost",
            registry=registry,
        )
        self.batch_rows = Histogram(
            "postbox_relay_batch_rows",
            "Rows per claimed batch",
            registry=registry,
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000),
        )
        self.batch_seconds = Histogram(
            "postbox_relay_batch_duration_seconds",
            "Claim, publish and mark of one batch",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.shards_owned = Gauge(
            "postbox_relay_shards_owned", "Outbox shards this replica holds", registry=registry
        )
        self.leases_lost = Counter(
            "postbox_relay_leases_lost_total", "Shard leases that expired while held", registry=registry
        )
        self.blocked_topics = Gauge(
            "postbox_relay_blocked_topics",
            "Topics held back by a configuration error (unknown, not authorised)",
            registry=registry,
        )
