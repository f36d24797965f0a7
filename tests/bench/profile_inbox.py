"""Where the inbox consumer's time goes: `postbox inbox consume`'s loop with a do-nothing handler, run in
this process under cProfile on servers of its own (not a test: it prints the profile and the rate).

    python -m tests.bench.profile_inbox                       # 200,000 messages of 200 bytes, batch 500
    python -m tests.bench.profile_inbox --messages 100000 --batch-size 1000 --top 40

The rate printed here is under the profiler (slower than without it); the benchmark's figure is
`python -m tests.bench.run --only consumers`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
import time
import uuid

import psycopg

from postbox.inbox.consumer import ConsumerSettings, InboxConsumer
from postbox.relay.core.logging import configure_logging
from postbox.relay.devstack.kafka import LocalKafka
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from tests.apps.noop import inbox
from tests.bench.harness.servers import PARTITIONS, BenchServers
from tests.bench.harness.traffic import payload_of
from tests.bench.parts.limits import bench_raw_producer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--top", type=int, default=30, help="functions to list, by own time")
    args = parser.parse_args()
    configure_logging("console", "info")  # the consumer's per-batch debug lines would drown the profile
    postgres = LocalPostgres(find_bin_dir()).start()
    kafka = LocalKafka(default_partitions=PARTITIONS).start()
    s = BenchServers(postgres, kafka)
    try:
        _, topic = bench_raw_producer(s, args.messages, payload_of(200))
        s.fresh_schema()
        settings = ConsumerSettings(
            database_url=postgres.dsn,
            kafka_bootstrap=kafka.bootstrap,
            topics=[topic],
            group_id=f"profile-{uuid.uuid4().hex[:6]}",
            batch_size=args.batch_size,
        )
        consumer = InboxConsumer(inbox, settings)

        def stop_when_all_stored() -> None:
            with psycopg.connect(postgres.dsn, autocommit=True) as conn:
                while True:
                    row = conn.execute("SELECT count(*) FROM postbox.inbox_message").fetchone()
                    if row is not None and row[0] >= args.messages:
                        break
                    time.sleep(0.2)
            consumer.stop()

        watcher = threading.Thread(target=stop_when_all_stored, daemon=True)
        watcher.start()
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.runcall(consumer.run)
        elapsed = time.perf_counter() - started
        print(
            f"{args.messages:,} messages, batch {args.batch_size}: {elapsed:.1f} s under cProfile "
            f"(including the consumer's start and group join), {args.messages / elapsed:,.0f} msgs/s"
        )
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    finally:
        kafka.stop()
        postgres.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
