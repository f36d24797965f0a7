"""The "tracing" part (`python -m tests.bench.run --only tracing`): one relay's drain and steady-state latency
with OpenTelemetry absent, installed but off, and on (every span, 1% by the relay's sampler, 1% by the
writers' with the default parent-based sampler), exporting OTLP/HTTP to a receiver in this process. On the
servers tests.bench.run starts (tests.bench.harness.servers)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.bench.harness.servers import BenchServers
from tests.bench.harness.stats import median_spread, percentile
from tests.bench.harness.traffic import payload_of
from tests.bench.parts.drain import bench_drain
from tests.bench.parts.latency import LatencyRun, bench_latency
from tests.otlp import OtlpReceiver


@dataclass
class TracingVariant:
    label: str
    env: dict[str, str]  # added to the relay's environment
    sampled_every: int | None = None  # the writers propagate a trace context, one in this many sampled


def tracing_variants(sink: OtlpReceiver, folder: Path) -> list[TracingVariant]:
    """The relay's environments for the tracing part: OpenTelemetry absent (an importable-looking package
    that refuses to import shadows it, as on a machine without postbox[otel]), installed but off (no
    OTEL_* variable), on with every span exported to `sink` or 1% of them by the relay's own sampler
    (rows without a writer's context); then rows that carry a writer's context (its traceparent header,
    1% of them sampled), with the relay's tracing off and on with the default parent-based sampler."""
    hidden = folder / "opentelemetry"
    hidden.mkdir(exist_ok=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the benchmark: no OpenTelemetry")\n')
    python_path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    return [
        TracingVariant("OpenTelemetry not installed     ", {"PYTHONPATH": python_path}),
        TracingVariant("installed, tracing off          ", {}),
        TracingVariant("on, always_on                   ", {**exporting, "OTEL_TRACES_SAMPLER": "always_on"}),
        TracingVariant("on, relay samples 1%            ", {**exporting, **ratio}),
        TracingVariant("off, writers' context in rows   ", {}, sampled_every=100),
        TracingVariant("on, writers sample 1% (default) ", exporting, sampled_every=100),
    ]


def bench_tracing(
    s: BenchServers, rows: int, runs: int, latency_seconds: float, relay_args: tuple[str, ...]
) -> None:
    """The relay's drain and latency with tracing absent, off and on, interleaved run by run so that the
    machine's drift falls on every variant alike; spans go to an OTLP/HTTP receiver in this process."""
    sink = OtlpReceiver(decode=False)
    payload = payload_of(200)
    try:
        with tempfile.TemporaryDirectory() as folder:
            variants = tracing_variants(sink, Path(folder))
            drains: dict[str, list[tuple[float, float, float, float]]] = {v.label: [] for v in variants}
            exported: dict[str, int] = dict.fromkeys(drains, 0)
            for _ in range(runs):
                for v in variants:
                    before = sink.span_count
                    drains[v.label].append(
                        bench_drain(s, rows, payload, "postbox", 1, relay_args, v.env, v.sampled_every)
                    )
                    exported[v.label] += sink.span_count - before  # the relay flushes its spans on exit
            for label, results in drains.items():
                print(
                    f"drain {label}: events/s {median_spread([r[0] for r in results])}; "
                    f"relay CPU {statistics.median(r[2] for r in results) / rows * 1e6:.0f} us per event, "
                    f"whole machine {statistics.median(r[3] for r in results):.1f} s; peak RSS "
                    f"{max(r[1] for r in results):.0f} MB; spans exported "
                    f"{exported[label] / (rows * runs):.1%} of messages",
                    flush=True,
                )
            for rate in (1000, 5000):
                latencies: dict[str, list[LatencyRun]] = {v.label: [] for v in variants}
                for _ in range(runs):
                    for v in variants:
                        latencies[v.label].append(
                            bench_latency(
                                s,
                                rate,
                                latency_seconds,
                                "postbox",
                                payload,
                                relay_args=relay_args,
                                env=v.env,
                                sampled_every=v.sampled_every,
                            )
                        )
                for label, measured in latencies.items():
                    p50 = [percentile(r.latencies, 0.5) for r in measured]
                    p99 = [percentile(r.latencies, 0.99) for r in measured]
                    core = statistics.median(r.cpu_seconds for r in measured) / latency_seconds
                    print(
                        f"{rate}/s {label}: commit->consumer p50 {median_spread(p50, 1)} ms, "
                        f"p99 {median_spread(p99, 1)} ms; relay CPU {core:.0%} of a core",
                        flush=True,
                    )
    finally:
        sink.close()


def run_part(
    s: BenchServers, args: argparse.Namespace, relay_args: tuple[str, ...], say: Callable[[str], None]
) -> None:
    """The heading, then bench_tracing's figures."""
    rows = min(args.rows, 300_000)
    say(
        f"\n-- tracing: the relay with OpenTelemetry absent, off and on (spans over OTLP/HTTP to a "
        f"receiver in the benchmark's process, the SDK's default batch processor); drain of {rows:,} "
        f"rows of 200 bytes, and steady state as above; rows without a trace context unless the "
        f"variant names the writers'; runs interleaved --"
    )
    bench_tracing(s, rows, args.runs, args.latency_seconds, relay_args)
