"""How long a bare librdkafka transaction takes on a broker of its own, without postbox: a transactional
producer sends 20 messages (6 partitions) per transaction, waits for their acks, commits; 60 transactions
per setting, with `PAUSE` seconds between them (0: back to back, as a busy exactly-once relay's group).

    python -m tests.bench.transactions_probe 0       # back to back
    python -m tests.bench.transactions_probe 0.02

Prints produce->ack and commit times (p50, p90, ms) with librdkafka's defaults, with retry.backoff.ms 5
and retry.backoff.max.ms 50 (the relay's for its transactional producers), and with linger.ms 0 besides.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from postbox.relay.devstack.kafka import LocalKafka

SETTINGS: list[dict[str, int]] = [
    {},
    {"retry.backoff.ms": 5, "retry.backoff.max.ms": 50},
    {"retry.backoff.ms": 5, "retry.backoff.max.ms": 50, "linger.ms": 0},
]


def _counter(done: list[None]) -> Callable[[object, object], None]:
    return lambda _error, _message: done.append(None)


def main() -> int:
    pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    kafka = LocalKafka(default_partitions=6).start()
    try:
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        admin.create_topics([NewTopic("probe", 6, 1)])["probe"].result(30)
        for number, extra in enumerate(SETTINGS):
            producer = Producer(
                {
                    "bootstrap.servers": kafka.bootstrap,
                    "transactional.id": f"probe-{number}",
                    "linger.ms": 5,
                    "acks": "all",
                    **extra,
                }
            )
            producer.init_transactions(10)
            acks: list[float] = []
            commits: list[float] = []
            for _ in range(60):
                producer.begin_transaction()
                began = time.perf_counter()
                done: list[None] = []
                for key in range(20):
                    producer.produce("probe", b"v", str(key).encode(), on_delivery=_counter(done))
                while len(done) < 20:
                    producer.poll(0.001)
                acked = time.perf_counter()
                producer.commit_transaction(10)
                acks.append((acked - began) * 1000)
                commits.append((time.perf_counter() - acked) * 1000)
                time.sleep(pause)
            acks.sort()
            commits.sort()
            print(
                f"{extra or 'defaults'}: produce->ack p50 {acks[30]:.1f} p90 {acks[54]:.1f} ms; commit p50 "
                f"{commits[30]:.1f} p90 {commits[54]:.1f} ms (pause {pause:g} s)",
                flush=True,
            )
    finally:
        kafka.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
