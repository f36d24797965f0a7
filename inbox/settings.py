"""The settings of each `postbox inbox ...` command, declared once (see relay.core.settings).

Namespaces: the Kafka inbox reads POSTBOX_INBOX_*, the webhook receiver, worker and reconciler
POSTBOX_WEBHOOK_*; the connection settings, logging and the metrics address are shared."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from postbox.inbox.consumer import ConsumerSettings
from postbox.inbox.helpers import DEFAULT_INBOX_RETENTION
from postbox.inbox.webhooks.config import ProviderSettings
from postbox.inbox.webhooks.store import DEFAULT_WEBHOOK_RETENTION
from postbox.relay.core.settings import (
    DatabaseSettings,
    Renamed,
    Settings,
    SettingsError,
    duration,
    setting,
    shared_database_url,
    shared_kafka_bootstrap,
    shared_kafka_config,
    shared_metrics_address,
    shared_schema,
)


def _app_spec(value: str) -> str:
    module, _, attribute = value.partition(":")
    if not module or not attribute:
        raise ValueError("is not module:attribute (e.g. billing.handlers:inbox)")
    return value


@dataclass(frozen=True, kw_only=True)
class ConsumeSettings(ConsumerSettings):
    """`postbox inbox consume`: the consumer's settings plus the app and the ops port."""

    app: str = setting(
        "", "your handlers: module:attribute naming an inbox.Inbox", parse=_app_spec, required=True
    )
    schema: str | None = shared_schema(None)  # unset: the schema the app's Inbox names
    metrics_address: str | None = shared_metrics_address(None)

    def check(self) -> None:
        super().check()
        if not self.topics:
            raise SettingsError(f"{self.label('topics')}: required (at least one topic)")


@dataclass(frozen=True, kw_only=True)
class RequeueSettings(Settings):
    """`postbox inbox requeue`: the app, and where to read its parked messages again."""

    PREFIX: ClassVar[str] = "POSTBOX_INBOX_"

    database_url: str = shared_database_url()
    schema: str | None = shared_schema(None)
    app: str = setting(
        "", "your handlers: module:attribute naming an inbox.Inbox", parse=_app_spec, required=True
    )
    kafka_bootstrap: str = shared_kafka_bootstrap()
    kafka_config: dict[str, str] = shared_kafka_config()


@dataclass(frozen=True, kw_only=True)
class InboxPruneSettings(DatabaseSettings):
    """`postbox inbox prune`."""

    older_than: timedelta = setting(
        DEFAULT_INBOX_RETENTION,
        "delete inbox rows older than this (keep it past the providers' replay windows)",
        env="POSTBOX_INBOX_RETENTION",
        bounds=(1, 1e9),
    )
    include_failed: bool = setting(
        False,
        "also delete parked (failed) messages past the retention; they were never applied, so by default "
        "they stay for `postbox inbox requeue`",
        env="POSTBOX_INBOX_PRUNE_FAILED",
    )


@dataclass(frozen=True, kw_only=True)
class ServeSettings(ProviderSettings):
    """`postbox inbox serve`: the webhook receiver."""

    SERVICE: ClassVar[str] = "receiver"

    database_url: str = shared_database_url()
    schema: str = shared_schema()
    host: str = setting("0.0.0.0", "address to listen on")  # noqa: S104
    port: int = setting(8080, "port for the webhook routes", bounds=(0, 65_535))
    max_body_bytes: int = setting(1 << 20, "larger bodies get 413", bounds=(1024, 1 << 30))
    pool_size: int = setting(10, "database connections (per process)", bounds=(1, 1000))
    workers: int = setting(
        1,
        "receiver processes sharing the port, each with its own pool (not the `inbox work` webhook workers)",
        bounds=(1, 64),
    )
    read_timeout: float = setting(
        10.0,
        "seconds a client may take to send a request's headers, and again its body (else 408)",
        bounds=(0.5, 300),
    )
    max_connections: int = setting(
        1000,
        "connections and requests at once, per process; past it, 503 (kept below the file-descriptor limit)",
        bounds=(16, 100_000),
    )
    metrics_address: str | None = shared_metrics_address(None)


@dataclass(frozen=True, kw_only=True)
class WorkSettings(Settings):
    """`postbox inbox work`: the webhook worker."""

    PREFIX: ClassVar[str] = "POSTBOX_WEBHOOK_"
    SERVICE: ClassVar[str] = "webhook-worker"

    database_url: str = shared_database_url()
    schema: str | None = shared_schema(None)
    app: str = setting(
        "",
        "your handlers: module:attribute naming an inbox.webhooks.Webhooks",
        parse=_app_spec,
        required=True,
    )
    batch_size: int = setting(
        20, "events claimed at a time", bounds=(1, 1000), retired=("POSTBOX_BATCH_SIZE",)
    )
    poll_interval: float = setting(
        0.5, "seconds between polls when idle", bounds=(0.05, 60), renamed=(Renamed("POSTBOX_POLL_INTERVAL"),)
    )
    reap_interval: float = setting(
        10.0,
        "seconds between runs of the reaper (events whose worker died mid-way go back to pending)",
        bounds=(0.1, 3600),
        renamed=(Renamed("POSTBOX_REAP_INTERVAL"),),
    )
    metrics_address: str | None = shared_metrics_address(None)


@dataclass(frozen=True, kw_only=True)
class ReconcileSettings(DatabaseSettings):
    """`postbox inbox reconcile`."""

    PREFIX: ClassVar[str] = "POSTBOX_WEBHOOK_"

    app: str = setting(
        "",
        "module:attribute naming a Reconciler (or a class or function that makes one)",
        parse=_app_spec,
        env="POSTBOX_WEBHOOK_RECONCILER",
        required=True,
        renamed=(Renamed("POSTBOX_RECONCILER"),),
    )
    since: timedelta = setting(
        timedelta(days=3),
        "how far back to look",
        env="POSTBOX_WEBHOOK_RECONCILE_SINCE",
        bounds=(1, 1e9),
        renamed=(Renamed("POSTBOX_RECONCILE_SINCE"),),
    )
    every: timedelta | None = setting(
        None,
        "repeat on this schedule (once when unset)",
        parse=duration,
        env="POSTBOX_WEBHOOK_RECONCILE_EVERY",
        bounds=(1, 1e9),
        renamed=(Renamed("POSTBOX_RECONCILE_EVERY"),),
    )


@dataclass(frozen=True, kw_only=True)
class WebhookPruneSettings(DatabaseSettings):
    """`postbox inbox prune-webhooks`."""

    older_than: timedelta = setting(
        DEFAULT_WEBHOOK_RETENTION,
        "delete processed webhook rows older than this (keep it past the providers' replay windows)",
        env="POSTBOX_WEBHOOK_RETENTION",
        bounds=(1, 1e9),
    )
    include_failed: bool = setting(
        False,
        "also delete failed events past the retention; they were never applied, so by default they stay "
        "for `postbox inbox requeue-webhooks`",
        env="POSTBOX_WEBHOOK_PRUNE_FAILED",
    )
