"""Where the webhook receiver's time goes: `postbox inbox serve` under wrk (distinct, correctly signed
Stripe events, as in the benchmark), sampled by py-spy on servers of its own (not a test: it prints the
functions that hold the most samples, by own time and by total time, and wrk's figures).

    python -m tests.bench.profile_webhooks                       # 64 connections, 15 s, one process
    python -m tests.bench.profile_webhooks --connections 16 --workers 2 --top 40

py-spy (`pip install py-spy`) samples without slowing the process much, so the rate printed is close to
the benchmark's; the benchmark's figure is `python -m tests.bench.run --only webhooks`.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg

from postbox.relay.core.migrate import migrate
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from tests.bench.harness.servers import SCHEMA, process_usage
from tests.bench.parts.webhooks import run_wrk, signed_stripe_requests, workers_flag
from tests.support.processes import ReceiverProcess


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--top", type=int, default=30, help="functions to list")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    postgres = LocalPostgres(find_bin_dir()).start()
    folder = signed_stripe_requests(60_000)
    try:
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            migrate(conn, SCHEMA)
        with ReceiverProcess(postgres.dsn, SCHEMA, *workers_flag(args.workers), log_level="info") as receiver:
            serving = receiver.serving_pids()  # with workers, the parent only supervises
            samples = [Path(folder, f"py-spy-{pid}.txt") for pid in serving]
            spies = [
                subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(args.seconds),
                        "--rate",
                        "200",
                        "--format",
                        "raw",
                        "--output",
                        str(out),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for pid, out in zip(serving, samples, strict=True)
            ]
            result = run_wrk(receiver.url, folder, args.connections, args.seconds)
            for spy in spies:
                spy.wait(timeout=60)
            cpu = sum(process_usage(pid)[1] for pid in serving)
            assert receiver.terminate() == 0
        print(
            f"wrk: {args.connections} connections, {args.seconds} s, {args.workers} worker(s): "
            f"{result.rate:,.0f} requests/s, p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms; "
            f"receiver CPU {cpu:.1f} s, {cpu / max(1, result.answered_2xx) * 1e6:.0f} us per request"
        )
        own: collections.Counter[str] = collections.Counter()
        total: collections.Counter[str] = collections.Counter()
        count = 0
        for path in samples:
            for line in path.read_text().splitlines():
                stack, _, weight = line.rpartition(" ")
                frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
                if not frames:
                    continue
                n = int(weight)
                count += n
                own[frames[-1]] += n
                for frame in set(frames):
                    total[frame] += n
        for title, counter in (("own time", own), ("total time (the frame or what it called)", total)):
            print(f"\n-- {title}: share of {count:,} samples --")
            for frame, n in counter.most_common(args.top):
                print(f"{n / count:6.1%}  {frame}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
