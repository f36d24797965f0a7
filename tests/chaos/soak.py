"""The soak: writers, three relays and two inbox consumers on real servers of its own, with faults on a
schedule, judged at the end by the independent checker (tests/chaos/checker.py).

    python -m tests.chaos.soak --duration 1800          # the long run the docs report
    python -m tests.chaos.soak --duration 60 --fault-every 5

Faults: a relay SIGKILLed (and replaced), a relay SIGSTOPped past its lease (a zombie) and resumed, a
consumer SIGKILLed (and replaced), the broker SIGSTOPped past the delivery timeout, the broker SIGKILLed
and restarted, PostgreSQL restarted in immediate mode, and the relays' database sessions terminated.
Exit status 0 only when nothing was lost, no order broke and nothing was applied twice.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from postbox.relay.devstack.kafka import LocalKafka
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir
from postbox.relay.outbox import OutboxEvent, enqueue_many
from tests.apps.ledger import SCHEMA_SQL
from tests.chaos.checker import Report, check
from tests.support.database import outbox_states, prepare_outbox, shard_owners
from tests.support.kafka import create_topic, read_topic
from tests.support.processes import InboxProcess, RelayProcess
from tests.support.waiting import wait_until

SCHEMA = "postbox"
AGGREGATE_TYPE = "soak"
TOPIC = f"outbox.event.{AGGREGATE_TYPE}"
RELAY_ARGS = ("--batch-size", "200", "--delivery-timeout", "5")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Writer(threading.Thread):
    """Commits sequenced events for aggregates it alone owns, reconnecting through faults. What counts as
    written is read back from the outbox at the end, so an ambiguous commit cannot fool the checker."""

    def __init__(self, dsn: str, name: str, aggregates: int, rate: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rate, self.stop_event = dsn, rate, stop
        self.aggregates = [f"{name}-a{i}" for i in range(aggregates)]
        self.rng = random.Random(name)
        self.commits = self.errors = 0

    def _resume_sequences(self, conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, int]:
        rows = conn.execute(
            "SELECT aggregate_id, max((payload->>'seq')::int) FROM postbox.outbox "
            "WHERE aggregate_id = ANY(%s) GROUP BY 1",
            (self.aggregates,),
        ).fetchall()
        conn.commit()
        found = {str(a): int(str(s)) + 1 for a, s in rows}
        return {a: found.get(a, 0) for a in self.aggregates}

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                    next_seq = self._resume_sequences(conn)
                    while not self.stop_event.is_set():
                        batch = []
                        for _ in range(self.rng.randint(1, 3)):
                            aggregate = self.rng.choice(self.aggregates)
                            batch.append(
                                OutboxEvent(
                                    AGGREGATE_TYPE,
                                    aggregate,
                                    "Changed",
                                    {"seq": next_seq[aggregate], "pad": "x" * 150},
                                )
                            )
                            next_seq[aggregate] += 1
                        enqueue_many(conn, batch, schema=SCHEMA)
                        conn.commit()
                        self.commits += 1
                        self.stop_event.wait(len(batch) / self.rate)
            except psycopg.Error:
                self.errors += 1
                self.stop_event.wait(0.5)  # the database is restarting: reconnect and read back sequences


@dataclass
class Cluster:
    postgres: LocalPostgres
    kafka: LocalKafka
    relays: list[RelayProcess] = field(default_factory=list)
    consumers: list[InboxProcess] = field(default_factory=list)
    paused: list[Callable[[], None]] = field(default_factory=list)
    mode: str = "queue"  # the relays' --mode (the outbox is switched to match)
    exactly_once: bool = False  # the relays run with --exactly-once (log mode)

    def replace_crashed(self) -> list[str]:
        """Processes that exited although nobody killed them (a bug): noted, logged, replaced."""
        found = []
        for group, start in ((self.relays, self.relay), (self.consumers, self.consumer)):
            for index, process in enumerate(group):
                if process.process.poll() is not None:
                    found.append(f"{process.log_path} exited {process.process.returncode}")
                    log(f"CRASHED: {found[-1]}")
                    process.__exit__()
                    group[index] = start()
        return found

    def relay(self) -> RelayProcess:
        extra = ("--exactly-once",) if self.exactly_once else ()
        return RelayProcess(
            self.postgres.dsn, self.kafka.bootstrap, SCHEMA, *RELAY_ARGS, "--mode", self.mode, *extra
        )

    def consumer(self) -> InboxProcess:
        return InboxProcess(
            self.postgres.dsn,
            self.kafka.bootstrap,
            SCHEMA,
            "tests.apps.ledger:inbox",
            [TOPIC],
            "--batch-size",
            "200",
        )


def fault_kill_relay(c: Cluster, rng: random.Random) -> str:
    victim = rng.choice(c.relays)
    victim.kill()
    victim.__exit__()
    c.relays[c.relays.index(victim)] = c.relay()
    return f"SIGKILL relay {victim.relay_id}, started a replacement"


def fault_pause_relay(c: Cluster, rng: random.Random) -> str:
    victim = rng.choice(c.relays)
    victim.pause()
    paused = time.monotonic()
    # Past its 3 s lease: the others take its shards and end its sessions; then it wakes as a zombie.
    wait_until(
        lambda: victim.relay_id not in shard_owners(c.postgres.dsn, SCHEMA) and not _sessions_of(c, victim),
        90,
        interval=0.5,
        what=f"relay {victim.relay_id}'s shards taken and its sessions ended while it is stopped",
    )
    victim.resume()
    return (
        f"SIGSTOP relay {victim.relay_id} until the others took its shards and ended its sessions "
        f"({time.monotonic() - paused:.0f} s, a zombie), then SIGCONT"
    )


def _sessions_of(c: Cluster, relay: RelayProcess) -> int:
    with psycopg.connect(c.postgres.dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (f"postbox-relay {relay.relay_id}",),
        ).fetchone()
    return int(str(found[0])) if found else 0


def fault_kill_consumer(c: Cluster, rng: random.Random) -> str:
    victim = rng.choice(c.consumers)
    victim.process.kill()
    victim.__exit__()
    c.consumers[c.consumers.index(victim)] = c.consumer()
    return "SIGKILL an inbox consumer, started a replacement"


def fault_pause_broker(c: Cluster, rng: random.Random) -> str:
    node = rng.choice(c.kafka.nodes)
    c.kafka.pause_node(node)
    # The fault's length, not a wait for anything: past the relays' 5 s delivery timeout (and, in a
    # cluster, past its session timeout).
    time.sleep(8)
    c.kafka.resume_node(node)
    return f"SIGSTOP broker {node.node_id} for 8 s (past the delivery timeout), then SIGCONT"


def fault_kill_broker(c: Cluster, rng: random.Random) -> str:
    node = rng.choice(c.kafka.nodes)
    c.kafka.stop_node(node, kill=True)
    time.sleep(3)  # the fault's length, not a wait for anything: three seconds without the node
    c.kafka.start_node(node)
    return f"SIGKILL broker {node.node_id}, restarted it 3 s later"


def fault_restart_postgres(c: Cluster, rng: random.Random) -> str:
    c.postgres.restart_immediate()
    return "PostgreSQL restarted in immediate mode (crash recovery)"


def fault_terminate_relay_backends(c: Cluster, rng: random.Random) -> str:
    with psycopg.connect(c.postgres.dsn, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name LIKE 'postbox-relay %'"
        ).fetchone()
    return f"terminated {ended[0] if ended else 0} relay database sessions"


FAULTS = [
    fault_kill_relay,
    fault_pause_relay,
    fault_kill_consumer,
    fault_pause_broker,
    fault_kill_broker,
    fault_restart_postgres,
    fault_terminate_relay_backends,
]


def written_events(dsn: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT event_id::text, aggregate_id, (payload->>'seq')::int FROM postbox.outbox"
        ).fetchall()
    return {str(e): (str(a), int(str(s))) for e, a, s in rows}


def effects(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(r[0]) for r in conn.execute("SELECT message_id FROM public.effects").fetchall()]


def run_soak(
    duration: float,
    rate: float,
    fault_every: float,
    seed: int,
    brokers: int = 1,
    mode: str = "queue",
    exactly_once: bool = False,
) -> Report:
    """With brokers=3 the topic has three replicas (min.insync.replicas 2) and broker faults hit one node at
    random: leadership moves while the relays keep producing. mode: the relays' --mode (queue or log);
    exactly_once: the relays run with --exactly-once (log mode), and the broker is read as a
    read_committed consumer reads it (as always: librdkafka's default)."""
    rng = random.Random(seed)
    postgres = LocalPostgres(find_bin_dir()).start()
    kafka = LocalKafka(nodes_count=brokers, default_partitions=6).start()
    cluster = Cluster(postgres, kafka, mode=mode, exactly_once=exactly_once)
    stop_writers = threading.Event()
    writers: list[Writer] = []
    try:
        prepare_outbox(postgres.dsn, SCHEMA, mode)
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA_SQL)
        create_topic(kafka.bootstrap, TOPIC, 6, replication=brokers)
        cluster.relays = [cluster.relay() for _ in range(3)]
        cluster.consumers = [cluster.consumer() for _ in range(2)]
        writers = [
            Writer(postgres.dsn, f"w{i}-{uuid.uuid4().hex[:4]}", 10, rate / 2, stop_writers) for i in range(2)
        ]
        for writer in writers:
            writer.start()
        log(
            f"soak: {duration:.0f} s, {rate:g} events/s, a fault every ~{fault_every:g} s, seed {seed}, "
            f"{brokers} broker(s), relays in {mode} mode{' with --exactly-once' if exactly_once else ''}"
        )
        deadline = time.monotonic() + duration
        faults: Counter_ = {}
        crashed: list[str] = []
        round_left: list[Callable[[Cluster, random.Random], str]] = []
        while time.monotonic() < deadline:
            # Pacing, not waiting: the faults' schedule, one every ~fault_every seconds.
            time.sleep(min(rng.uniform(0.5, 1.5) * fault_every, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
            crashed += cluster.replace_crashed()
            # Every kind once in a shuffled round before any repeats, so even a short run sees them all.
            if not round_left:
                round_left = rng.sample(FAULTS, len(FAULTS))
            fault = round_left.pop()
            log(fault(cluster, rng))
            faults[fault.__name__] = faults.get(fault.__name__, 0) + 1
        stop_writers.set()
        for writer in writers:
            writer.join(timeout=30)
        written = written_events(postgres.dsn)
        log(f"writers stopped: {len(written)} events committed; draining")
        wait_until(lambda: _drained(postgres.dsn), 180, interval=1, what="the outbox drained")
        wait_until(
            lambda: len(set(effects(postgres.dsn))) >= len(written),
            180,
            interval=1,
            what="the consumers caught up",
        )
        records = read_topic(kafka.bootstrap, TOPIC, expected=len(written), timeout=120, settle=3)
        crashed += cluster.replace_crashed()
        report = check(written, records, effects(postgres.dsn))
        report.crashed = crashed
        codes = [r.terminate() for r in cluster.relays] + [c.terminate() for c in cluster.consumers]
        log(f"faults injected: {json.dumps(faults)}; exit codes after SIGTERM: {codes}")
        for line in report.lines():
            log(line)
        return report
    finally:
        stop_writers.set()
        for process in [*cluster.relays, *cluster.consumers]:
            process.__exit__()
        kafka.stop()
        postgres.stop()


Counter_ = dict[str, int]


def _drained(dsn: str) -> bool:
    return set(outbox_states(dsn, SCHEMA)) <= {"published"}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of writing and faults")
    parser.add_argument("--rate", type=float, default=200.0, help="events written per second")
    parser.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--brokers", type=int, choices=[1, 3], default=1, help="Kafka nodes (3: replicated)")
    parser.add_argument("--mode", choices=["queue", "log"], default="queue", help="the relays' --mode")
    parser.add_argument("--exactly-once", action="store_true", help="the relays' --exactly-once (log mode)")
    args = parser.parse_args()

    # Started in the background, a process ignores SIGINT; SIGTERM must still stop it with its cleanup
    # (the servers and child processes it started) run.
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    if args.exactly_once and args.mode != "log":
        parser.error("--exactly-once needs --mode log")
    report = run_soak(
        args.duration, args.rate, args.fault_every, args.seed, args.brokers, args.mode, args.exactly_once
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
