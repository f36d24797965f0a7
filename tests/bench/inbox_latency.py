"""The inbox consumer's latency, end to end, beside a plain Kafka consumer on the same topic (issue 34), on
servers of its own (not a test: it prints figures and the setup that produced them).

    python -m tests.bench.inbox_latency                          # 10, 100 and 1,000 events/s, 3 runs each
    python -m tests.bench.inbox_latency --rates 100 --runs 1     # a quick look
    git worktree add --detach /tmp/inbox-before 4a55561
    python -m tests.bench.inbox_latency --inbox-code /tmp/inbox-before   # before/after, alternated

Each measurement: a fresh outbox (log mode, as `postbox migrate` creates one) and a topic of its own;
writers commit one event per transaction at the asked rate through `enqueue` (4 connections, evenly
staggered), each writer taking the time right after its commit returns; a relay with the defaults (`postbox
relay run`, a child process) publishes them; `postbox inbox consume` with the defaults (a child process,
its app tests.apps.inbox_latency, whose handler writes down the time it ran for each message) and a plain
confluent-kafka consumer (a process of its own, fetch.wait.max.ms 5) on the same topic write down their
receipt times. Per message, matched by event id: commit -> plain consumer, commit -> handler, and handler
minus plain consumer. Every process is on this machine and every time is time.time(), one clock.

--inbox-code runs the inbox consumer (only it: the relay, writers and apps stay this checkout's) from
another checkout as well: the child's `postbox` package is that checkout's (see Code.env), and the
handler's file says which package it imported, checked. The two alternate within each rate, the order
flipping from run to run. The throughput part runs "The inbox consumer against its limit" of
tests/bench/parts/consumers.py (its bench_inbox, 200,000 messages of 200 bytes, its four variants) for each
checkout on the same topic in each run, alternating the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

import confluent_kafka
import psycopg
from confluent_kafka import Consumer

from postbox import __version__, enqueue
from postbox.relay.devstack.kafka import LocalKafka, kafka_version
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from tests.bench.harness.servers import PARTITIONS, BenchServers, publishing
from tests.bench.harness.stats import median_spread, percentile
from tests.bench.harness.traffic import WRITERS, payload_of
from tests.bench.parts.consumers import INBOX_BATCHES, bench_inbox, bench_raw_consumer
from tests.bench.parts.limits import bench_raw_producer
from tests.support.processes import InboxProcess
from tests.support.repo import REPO
from tests.support.waiting import wait_until

APP = "tests.apps.inbox_latency:inbox"
SERIES = ("commit->plain", "commit->handler", "handler-plain")
# handler-plain split at the start of the inbox's transaction (inbox_message.received_at, now() in the
# claim's transaction: the batch's start): the inbox's fetch and its wait for the batch before, then the
# claim statement and the handlers ahead of it in the batch.
BREAKDOWN = ("plain->batch start", "batch start->handler")
# The plain consumer: what librdkafka needs to hand a message over as soon as the broker has it.
PLAIN_CONSUMER = {"fetch.wait.max.ms": 5, "fetch.min.bytes": 1, "auto.offset.reset": "earliest"}
# Issue 34's targets, ms: handler-plain p50 and p99, commit->handler p50.
TARGETS = {("handler-plain", 0.5): 10.0, ("handler-plain", 0.99): 25.0, ("commit->handler", 0.5): 30.0}


@dataclass(frozen=True)
class Code:
    """A checkout to run the inbox consumer from."""

    label: str
    root: Path
    links: Path  # a folder holding only a link to the checkout's postbox package

    @classmethod
    def at(cls, label: str, root: Path, folder: Path) -> Code:
        links = folder / label
        links.mkdir()
        (links / "postbox").symlink_to(root.resolve() / "postbox")
        return cls(label, root.resolve(), links)

    def env(self) -> dict[str, str]:
        # `postbox` is found in `links` before anywhere else: first on PYTHONPATH, and PYTHONSAFEPATH keeps
        # -m from putting the child's current directory (this repository) ahead of it. Only the package
        # is linked, so the app (tests.apps...) still comes from this repository, which --app adds.
        return {"PYTHONPATH": str(self.links), "PYTHONSAFEPATH": "1"}

    def describe(self) -> str:
        def git(*args: str) -> str:
            return subprocess.run(
                ["git", "-C", str(self.root), *args], capture_output=True, text=True, check=False
            ).stdout.strip()

        changed = (
            " with uncommitted changes under inbox/" if git("status", "--porcelain", "--", "inbox") else ""
        )
        return f"{self.label} = {self.root} at {git('rev-parse', '--short', 'HEAD')}{changed}"


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment, which the child processes started meanwhile inherit."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_times(path: Path) -> dict[str, float]:
    """`<id> <time>` lines: each id's first time (a handler may run again after a rollback)."""
    times: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            event_id, _, at = line.partition(" ")
            if event_id != "#" and at:
                with contextlib.suppress(ValueError):
                    times.setdefault(event_id, float(at))
    return times


def plain_consumer(bootstrap: str, topic: str, path: str, joined: Event, stop: Event) -> None:
    """A plain confluent-kafka consumer (a process of its own: no GIL shared with the writers) writing down
    when each message reached it."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"plain-{uuid.uuid4().hex[:6]}", **PLAIN_CONSUMER}
    )
    consumer.subscribe([topic], on_assign=lambda *_: joined.set())
    with Path(path).open("a", buffering=1) as out:
        while not stop.is_set():
            message = consumer.poll(0.05)
            if message is None or message.error():
                continue
            at = time.time()
            event_id = dict(message.headers() or [])["id"]
            assert isinstance(event_id, bytes)
            out.write(f"{event_id.decode()} {at}\n")
    consumer.close()


def write_events(
    dsn: str, aggregate_type: str, rate: float, seconds: float
) -> tuple[dict[str, float], float]:
    """WRITERS connections commit one event per transaction, together `rate` a second for `seconds`, evenly
    staggered. Returns each event's time right after its commit returned (its payload carries the time
    just before the commit: a payload is written before its transaction commits), and the seconds taken."""
    committed: dict[str, float] = {}
    pad = "x" * 150
    started = time.perf_counter() + 0.1

    def write(writer: int) -> None:
        with psycopg.connect(dsn) as conn:
            next_at, i = started + writer / rate, writer
            while next_at < started + seconds:
                time.sleep(max(0.0, next_at - time.perf_counter()))
                payload = {"order": f"o-{i % 1000}", "pad": pad, "written_at": time.time()}
                event_id = enqueue(conn, aggregate_type, f"o-{i % 1000}", "Placed", payload)
                conn.commit()
                committed[str(event_id)] = time.time()
                i += WRITERS
                next_at += WRITERS / rate

    threads = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return committed, time.perf_counter() - started


def warm_up(
    dsn: str, aggregate_type: str, seen: list[Callable[[], dict[str, float]]], inbox: InboxProcess
) -> None:
    """Events until each reader has taken one, then until each has every one: both are in their groups
    with their partitions, and nothing is queued when the clock starts (the broker serves a fresh topic's
    first fetches slowly)."""
    ids: set[str] = set()
    deadline = time.monotonic() + 90
    with psycopg.connect(dsn) as conn:
        while not all(ids & reader().keys() for reader in seen):
            if inbox.process.poll() is not None:
                raise RuntimeError(f"the inbox consumer stopped: {inbox.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the consumers got no warm-up event within 90 s")
            ids.add(str(enqueue(conn, aggregate_type, "warm-up", "WarmUp", {"warm_up": True})))
            conn.commit()
            time.sleep(0.2)
    wait_until(lambda: all(ids <= reader().keys() for reader in seen), 60, 0.1, "warm-up events everywhere")


@dataclass
class LatencyRun:
    achieved: float  # events/s committed
    count: int  # events seen by both readers
    series: dict[str, list[float]]  # ms per message, sorted, by SERIES and BREAKDOWN name
    batch_size: float  # the measured events per inbox transaction, on average


def measure_latency(s: BenchServers, code: Code, rate: float, seconds: float, folder: Path) -> LatencyRun:
    s.fresh_schema("log")  # what `postbox migrate` creates
    aggregate_type, topic = s.fresh_topic("inboxlat")
    tag = uuid.uuid4().hex[:6]
    handled_path, plain_path = folder / f"handled-{tag}", folder / f"plain-{tag}"
    context = multiprocessing.get_context("spawn")
    joined, stop = context.Event(), context.Event()
    plain = context.Process(
        target=plain_consumer, args=(s.kafka.bootstrap, topic, str(plain_path), joined, stop), daemon=True
    )
    with publishing(s, "postbox"):
        plain.start()
        try:
            if not joined.wait(60):
                raise RuntimeError("the plain consumer got no partitions within 60 s")
            with InboxProcess(
                s.postgres.dsn,
                s.kafka.bootstrap,
                "postbox",
                APP,
                [topic],
                "--group-id",
                f"bench-latency-{tag}",
                env={**code.env(), "POSTBOX_BENCH_HANDLED": str(handled_path)},
                log_level="info",
            ) as inbox:

                def handled() -> dict[str, float]:
                    return read_times(handled_path)

                def received() -> dict[str, float]:
                    return read_times(plain_path)

                warm_up(s.postgres.dsn, aggregate_type, [handled, received], inbox)
                ran = handled_path.read_text().splitlines()[0]
                if ran != f"# code {(code.root / 'postbox').resolve()}":
                    raise RuntimeError(f"the inbox ran other code than {code.root}: {ran}")
                committed, took = write_events(s.postgres.dsn, aggregate_type, rate, seconds)
                wait_until(
                    lambda: committed.keys() <= handled().keys() and committed.keys() <= received().keys(),
                    60,
                    0.2,
                    "every event handled and received",
                )
                assert inbox.terminate() == 0, inbox.log()[-2000:]
        finally:
            stop.set()
            plain.join(30)
    with psycopg.connect(s.postgres.dsn) as conn:
        rows = conn.execute("SELECT message_id, extract(epoch FROM received_at) FROM postbox.inbox_message")
        at_batch = {event_id: float(at) for event_id, at in rows}
    at_handler, at_plain = read_times(handled_path), read_times(plain_path)
    series: dict[str, list[float]] = {name: [] for name in (*SERIES, *BREAKDOWN)}
    for event_id, commit in committed.items():
        plain_at, handler_at, batch_at = at_plain[event_id], at_handler[event_id], at_batch[event_id]
        series["commit->plain"].append((plain_at - commit) * 1000)
        series["commit->handler"].append((handler_at - commit) * 1000)
        series["handler-plain"].append((handler_at - plain_at) * 1000)
        series["plain->batch start"].append((batch_at - plain_at) * 1000)
        series["batch start->handler"].append((handler_at - batch_at) * 1000)
    batches = len({at_batch[event_id] for event_id in committed})
    return LatencyRun(
        len(committed) / took,
        len(committed),
        {name: sorted(values) for name, values in series.items()},
        len(committed) / batches,
    )


def show_run(run: LatencyRun) -> str:
    figures = "; ".join(
        f"{name} p50 {percentile(values, 0.5):.1f} p99 {percentile(values, 0.99):.1f}"
        for name, values in run.series.items()
    )
    return f"achieved {run.achieved:,.1f}/s (n={run.count}, {run.batch_size:.1f} a batch); ms {figures}"


def bench_latency_rates(
    s: BenchServers,
    codes: list[Code],
    rates: list[float],
    seconds: float,
    runs: int,
    say: Callable[[str], None],
) -> None:
    with tempfile.TemporaryDirectory(prefix="inbox-latency-") as folder:
        # A broker just started is slow to serve its first groups: one short measurement, not shown.
        measure_latency(s, codes[0], 100, 3, Path(folder))
        for rate in rates:
            say(f"\n-- {rate:g} events/s, {seconds:g} s per run --")
            results: dict[str, list[LatencyRun]] = {code.label: [] for code in codes}
            for run in range(runs):
                for code in codes if run % 2 == 0 else codes[::-1]:
                    one = measure_latency(s, code, rate, seconds, Path(folder))
                    results[code.label].append(one)
                    say(f"{rate:g}/s {code.label:6} run {run + 1}: {show_run(one)}")
            for label, measured in results.items():
                say(f"{rate:g}/s {label:6} medians over {len(measured)} runs (min, max):")
                say(f"   achieved/s {median_spread([m.achieved for m in measured], 1)}")
                say(f"   events a batch {median_spread([m.batch_size for m in measured], 1)}")
                for name in (*SERIES, *BREAKDOWN):
                    for q in (0.5, 0.99):
                        values = [percentile(m.series[name], q) for m in measured]
                        target = TARGETS.get((name, q))
                        verdict = ""
                        if target is not None:
                            met = "met" if statistics.median(values) < target else "NOT met"
                            verdict = f"   [target < {target:g} ms: {met}]"
                        say(f"   {name:16} p{q * 100:g} ms {median_spread(values, 1)}{verdict}")


# The consumers part's inbox variants (batch, app, what the handler does), by the name --variants takes.
THROUGHPUT_VARIANTS = {
    **{f"noop{b}": (b, "tests.apps.noop:inbox", "no-op handler") for b in INBOX_BATCHES},
    "insert500": (500, "tests.apps.noop:writing", "one INSERT per message"),
}


def bench_throughput(
    s: BenchServers, codes: list[Code], messages: int, runs: int, names: list[str], say: Callable[[str], None]
) -> None:
    """tests/bench/parts/consumers.py, the "consumers" part (bench_inbox, its variants), for each checkout,
    on the same topic in each run, the checkouts' order flipping from run to run."""
    variants = [THROUGHPUT_VARIANTS[name] for name in names]
    say(
        f"\n-- throughput: {messages:,} messages of 200 bytes, {PARTITIONS} partitions "
        "(parts/consumers.py's bench_inbox) --"
    )
    raw: list[float] = []
    rates: dict[tuple[str, int], list[float]] = {
        (c.label, v): [] for c in codes for v in range(len(variants))
    }
    for run in range(runs):
        _, topic = bench_raw_producer(s, messages, payload_of(200))
        raw.append(bench_raw_consumer(s, topic, messages))
        for code in codes if run % 2 == 0 else codes[::-1]:
            with environment(code.env()):
                for v, (batch, app, _label) in enumerate(variants):
                    rate = bench_inbox(s, topic, messages, batch, app)[0]
                    rates[code.label, v].append(rate)
                    say(f"run {run + 1} {code.label:6} batch {batch:4}, {_label}: msgs/s {rate:,.0f}")
    say(f"raw confluent-kafka consumer msgs/s {median_spread(raw)}")
    for v, (batch, _app, label) in enumerate(variants):
        for code in codes:
            say(f"{code.label:6} batch {batch:4}, {label}: msgs/s {median_spread(rates[code.label, v])}")
        if len(codes) == 2:
            ratios = [a / b for a, b in zip(rates[codes[0].label, v], rates[codes[1].label, v], strict=True)]
            say(f"       {codes[0].label}/{codes[1].label} per run: {median_spread(ratios, 2)}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[10.0, 100.0, 1000.0],
        help="events/s, comma-separated (default 10,100,1000)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of writing per rate and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--inbox-code",
        type=Path,
        help="another checkout's root to run the inbox consumer from as well (labelled --inbox-code-label)",
    )
    parser.add_argument("--inbox-code-label", default="before")
    parser.add_argument("--only", choices=("latency", "throughput"), action="append", help="repeatable")
    parser.add_argument("--messages", type=int, default=200_000, help="the throughput part's messages")
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        default=list(THROUGHPUT_VARIANTS),
        help=f"the throughput part's, comma-separated (default {','.join(THROUGHPUT_VARIANTS)})",
    )
    args = parser.parse_args()
    parts = set(args.only or ("latency", "throughput"))
    if unknown := set(args.variants) - set(THROUGHPUT_VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    links = Path(tempfile.mkdtemp(prefix="inbox-code-"))
    codes = [Code.at("after" if args.inbox_code else "this", REPO, links)]
    if args.inbox_code:
        codes.append(Code.at(args.inbox_code_label, args.inbox_code, links))

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)

    def say(line: str) -> None:
        print(line, flush=True)

    postgres = LocalPostgres(
        find_bin_dir(), settings={"wal_level": "logical", "max_connections": "300"}
    ).start()
    kafka = LocalKafka(default_partitions=PARTITIONS).start()
    s = BenchServers(postgres, kafka)
    try:
        latency = (
            "latency: outbox in log mode, relay and inbox consumer with their defaults (inbox batch 500, "
            f"poll timeout 1 s), {WRITERS} writers, one event per transaction, plain consumer "
            f"{PLAIN_CONSUMER}, one clock (time.time(), one machine); "
        )
        say(
            f"setup: {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, postbox {__version__}, PostgreSQL {postgres.server_version()} "
            f"(fsync on, wal_level=logical, max_connections 300, else defaults), Kafka {kafka_version()} (1 "
            f"KRaft node, {PARTITIONS} partitions), librdkafka {confluent_kafka.libversion()[0]}, "
            f"confluent-kafka {confluent_kafka.version()[0]}; {latency if 'latency' in parts else ''}"
            f"{args.runs} runs; code: " + "; ".join(code.describe() for code in codes)
        )
        if "latency" in parts:
            bench_latency_rates(s, codes, args.rates, args.seconds, args.runs, say)
        if "throughput" in parts:
            bench_throughput(s, codes, args.messages, args.runs, args.variants, say)
    finally:
        kafka.stop()
        postgres.stop()
        shutil.rmtree(links)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
