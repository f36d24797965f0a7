"""The inbox consumer's Prometheus metrics, on a registry the caller creates."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class InboxMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry or CollectorRegistry()
        self.processed = Counter(
            "postbox_inbox_processed_total", "Messages applied by a handler", ["topic"], registry=registry
        )
        self.duplicates = Counter(
            "postbox_inbox_duplicates_total",
            "Messages skipped as already applied",
            ["topic"],
            registry=registry,
        )
        self.failed = Counter(
            "postbox_inbox_failed_total", "Messages parked as failed", ["topic"], registry=registry
        )
        self.retries = Counter(
            "postbox_inbox_handler_retries_total",
            "Handler attempts that failed and were retried",
            registry=registry,
        )
        self.lag = Gauge(
            "postbox_inbox_consumer_lag_messages",
            "Messages behind the partition's end",
            ["topic", "partition"],
            registry=registry,
        )
        self.handler_seconds = Histogram(
            "postbox_inbox_handler_duration_seconds",
            "One handler call",
            registry=registry,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
