"""PostgreSQL + Kafka together, with a state file so other terminals can find the running stack."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from relay.devstack.kafka import LocalKafka, cache_dir
from relay.devstack.postgres import LocalPostgres, find_bin_dir


def state_file() -> Path:
    return cache_dir() / "stack.json"


@dataclass(frozen=True)
class StackInfo:
    """What a client needs to reach a running local stack."""

    database_url: str
    kafka_bootstrap: str
    postgres_version: str
    kafka_version: str

    def as_env(self) -> dict[str, str]:
        return {"POSTBOX_DATABASE_URL": self.database_url, "POSTBOX_KAFKA_BOOTSTRAP": self.kafka_bootstrap}


def read_state() -> StackInfo | None:
    """The stack another `postbox dev up` started, if its state file says so and its owner still lives."""
    path = state_file()
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    try:
        os.kill(int(data.pop("pid")), 0)
    except (OSError, KeyError, ValueError):
        return None
    return StackInfo(**data)


@contextmanager
def local_stack(
    pg: str = "auto", kafka_nodes: int = 1, auto_create_topics: bool = True, publish_state: bool = False
) -> Iterator[tuple[LocalPostgres, LocalKafka, StackInfo]]:
    """Start both servers, yield them, and stop both (removing their data) whatever happens inside."""
    from relay.devstack.kafka import kafka_version  # noqa: PLC0415

    postgres = LocalPostgres(find_bin_dir(pg))
    kafka = LocalKafka(nodes_count=kafka_nodes, auto_create_topics=auto_create_topics)
    try:
        postgres.start()
        kafka.start()
        info = StackInfo(postgres.dsn, kafka.bootstrap, postgres.server_version(), kafka_version())
        # Another running stack keeps its state file: `postbox dev env` keeps pointing at that one.
        publish_state = publish_state and read_state() is None
        if publish_state:
            state_file().parent.mkdir(parents=True, exist_ok=True)
            state_file().write_text(json.dumps({**info.__dict__, "pid": os.getpid()}))
        yield postgres, kafka, info
    finally:
        if publish_state:
            state_file().unlink(missing_ok=True)
        kafka.stop()
        postgres.stop()
