"""The relay's Prometheus metrics, registered on a registry the caller creates (no import-time globals)."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Fine around 50 ms, where a latency objective usually sits, so its p99 can be read off.
COMMIT_TO_ACK_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


class BatchHistogram(Collector):
    """A histogram without labels that takes a batch's observations at once, exposed exactly as
    prometheus_client's Histogram is (buckets, count, sum). Histogram.observe takes two locks per value,
    which at one value per published event cost the drain about 2 us an event; this takes one per batch."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(float(b) for b in buckets)
        if list(self._bounds) != sorted(set(self._bounds)):
            raise ValueError(f"{name}: buckets must be distinct and ascending")
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        counts = [0] * len(self._counts)
        total = 0.0
        bounds = self._bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # the first bound >= value: le is inclusive
            total += value
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, self._bounds), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], buckets, total)
        yield family


OTHER_TOPICS = "(other)"


class TopicLabels:
    """The topic label of a metric sample: the topic itself for the first `limit` distinct ones, then
    OTHER_TOPICS. Writers choose topics (a row's topic column), and every distinct label value is a series
    the relay keeps, and Prometheus stores, for good: a writer routing to a new topic per row must not grow
    either without bound. Lanes call it from their threads; a set's add is atomic, and a race can only let
    a label or two past the limit."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, topic: str) -> str:
        if topic in self._seen:
            return topic
        if len(self._seen) >= self._limit:
            return OTHER_TOPICS
        self._seen.add(topic)
        return topic


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.topic_label = TopicLabels()  # the `topic` label of published and failed
        self.published = Counter(
            "postbox_relay_published_total", "Outbox rows published to Kafka", ["topic"], registry=registry
        )
        self.failed = Counter(
            "postbox_relay_failed_total",
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
        self.batch_stage_seconds = Histogram(
            "postbox_relay_batch_stage_seconds",
            "One batch's stages: claim (the claim statement), publish (to the broker's last ack), mark (the "
            "mark statement and commit)",
            ["stage"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.ready = Gauge("postbox_relay_ready", "1 while /readyz would answer 200", registry=registry)
        self.shards_owned = Gauge(
            "postbox_relay_shards_owned", "Outbox shards this replica holds", registry=registry
        )
        self.leases_lost = Counter(
            "postbox_relay_leases_lost_total", "Shard leases that expired while held", registry=registry
        )
        self.commit_to_ack = BatchHistogram(
            "postbox_relay_commit_to_ack_seconds",
            "From the writing transaction (created_at) to the broker's acknowledgement",
            COMMIT_TO_ACK_BUCKETS,
            registry,
        )
        self.backlog_rows = Gauge(
            "postbox_relay_backlog_rows",
            "Outbox rows waiting to be published: pending, logged and unread (log mode), and stranded",
            registry=registry,
        )
        self.oldest_pending_seconds = Gauge(
            "postbox_relay_oldest_pending_age_seconds",
            "Age of the oldest unpublished outbox row",
            registry=registry,
        )
        self.stranded_rows = Gauge(
            "postbox_relay_stranded_rows",
            "Committed outbox rows no relay will ever read (logged outside any window the relays read: a "
            "moved database, a disabled write guard); `postbox relay status` names them",
            registry=registry,
        )
        self.failed_rows = Gauge(
            "postbox_relay_failed_rows", "Outbox rows in state failed (parked)", registry=registry
        )
        self.unowned_shards = Gauge(
            "postbox_relay_unowned_shards", "Shards no live replica holds a lease on", registry=registry
        )
        self.outbox_partitions = Gauge(
            "postbox_relay_outbox_partitions",
            "The outbox's partitions by txid (besides the default and parked ones), by state: in_use (rows "
            "may still be added or read) or finished (waiting for the retention to empty them)",
            ["state"],
            registry=registry,
        )
        self.producer_queue_messages = Gauge(
            "postbox_relay_producer_queue_messages",
            "Messages in librdkafka's queue (statistics msg_cnt)",
            registry=registry,
        )
        self.broker_rtt_seconds = Gauge(
            "postbox_relay_broker_rtt_seconds",
            "Average produce round trip to each broker (librdkafka statistics)",
            ["broker"],
            registry=registry,
        )
        self.producer_retries = Gauge(
            "postbox_relay_producer_retries",
            "Produce request retries so far (librdkafka statistics txretries)",
            registry=registry,
        )
        self.log_tick_age_seconds = Gauge(
            "postbox_relay_log_tick_age_seconds",
            "Log mode: age of the newest tick (grows while no relay reads: nothing new, or no relay)",
            registry=registry,
        )
        self.log_cursor_lag_seconds = Gauge(
            "postbox_relay_log_cursor_lag_seconds",
            "Log mode: how far each shard's cursor is behind the newest tick (tick time)",
            ["shard"],
            registry=registry,
        )
        self.log_oldest_open_transaction_seconds = Gauge(
            "postbox_relay_log_oldest_open_transaction_seconds",
            "Log mode: age of the oldest transaction with an id still open: its outbox rows, if any, are "
            "published only after it commits; it holds back no other transaction's rows",
            registry=registry,
        )
        self.blocked_topics = Gauge(
            "postbox_relay_blocked_topics",
            "Topics held back by a configuration error (unknown, not authorised)",
            registry=registry,
        )
        # Exactly-once (--exactly-once): one Kafka transaction per batch.
        self.transactions = Counter(
            "postbox_relay_transactions_total",
            "Exactly-once: batch transactions by how they ended: committed, aborted (nothing of the batch "
            "is visible to read_committed consumers; tried again), unknown (the producer was replaced and "
            "the group read back)",
            ["ending"],
            registry=registry,
        )
        self.transaction_seconds = Histogram(
            "postbox_relay_transaction_duration_seconds",
            "Exactly-once: from begin_transaction to the end of the commit or abort",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.open_transaction_seconds = Gauge(
            "postbox_relay_open_transaction_age_seconds",
            "Exactly-once: age of this replica's oldest open transaction (0: none); read_committed "
            "consumers of its partitions see nothing past it until it ends (transaction.timeout.ms at most)",
            registry=registry,
        )
        self.groups_ready = Gauge(
            "postbox_relay_exactly_once_groups_ready",
            "Exactly-once: groups of shards this replica owns whose transactional producer is open and whose "
            "last settlement is read back",
            registry=registry,
        )


def record_librdkafka_statistics(metrics: RelayMetrics, stats_json: str) -> None:
    """librdkafka's statistics callback payload -> the gauges that matter for an outbox relay."""
    import json  # noqa: PLC0415

    stats = json.loads(stats_json)
    metrics.producer_queue_messages.set(stats.get("msg_cnt", 0))
    metrics.producer_retries.set(stats.get("txretries", 0))
    for broker in (stats.get("brokers") or {}).values():
        rtt = (broker.get("rtt") or {}).get("avg", 0)
        if broker.get("nodeid", -1) >= 0:  # skip bootstrap placeholders
            metrics.broker_rtt_seconds.labels(str(broker["nodeid"])).set(rtt / 1_000_000)
