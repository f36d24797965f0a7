"""PostgreSQL + Kafka together, with a state file per named stack so other terminals can find it.

Each stack has a name (`postbox dev up --name NAME`, default `default`) and its own state file, so two
stacks on one machine (a demo beside a dev stack, two terminals) never point `postbox dev env` at each
other's servers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from postbox.relay.devstack.kafka import LocalKafka, cache_dir
from postbox.relay.devstack.postgres import LocalPostgres, find_bin_dir

DEFAULT_STACK = "default"


def check_stack_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name):
        raise ValueError(f"stack name {name!r}: 1-40 of A-Z a-z 0-9 _ -")
    return name


def state_file(name: str = DEFAULT_STACK) -> Path:
    return cache_dir() / f"stack-{check_stack_name(name)}.json"


def running_stacks() -> list[str]:
    """Names of the stacks whose state file names a live owner."""
    names = sorted(
        p.name.removeprefix("stack-").removesuffix(".json") for p in cache_dir().glob("stack-*.json")
    )
    return [name for name in names if read_state(name) is not None]


@dataclass(frozen=True)
class StackInfo:
    """What a client needs to reach a running local stack."""

    database_url: str
    kafka_bootstrap: str
    postgres_version: str
    kafka_version: str

    def as_env(self) -> dict[str, str]:
        return {"POSTBOX_DATABASE_URL": self.database_url, "POSTBOX_KAFKA_BOOTSTRAP": self.kafka_bootstrap}


def read_state(name: str = DEFAULT_STACK) -> StackInfo | None:
    """The stack named `name`, if its state file says so and the process that wrote it still lives."""
    path = state_file(name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        os.kill(int(data.pop("pid")), 0)
        return StackInfo(**data)
    except (OSError, KeyError, ValueError, TypeError):
        return None  # gone, or a file this version did not write


@contextmanager
def local_stack(
    pg: str = "auto",
    kafka_nodes: int = 1,
    auto_create_topics: bool = True,
    publish_state: bool = False,
    name: str = DEFAULT_STACK,
) -> Iterator[tuple[LocalPostgres, LocalKafka, StackInfo]]:
    """Start both servers, yield them, and stop both (removing their data) whatever happens inside.
    publish_state: write the stack's state file under `name`, unless a live stack already holds it."""
    from postbox.relay.devstack.kafka import kafka_version  # noqa: PLC0415

    postgres = LocalPostgres(find_bin_dir(pg))
    kafka = LocalKafka(nodes_count=kafka_nodes, auto_create_topics=auto_create_topics)
    try:
        postgres.start()
        kafka.start()
        info = StackInfo(postgres.dsn, kafka.bootstrap, postgres.server_version(), kafka_version())
        # A live stack of the same name keeps its state file: `postbox dev env` keeps pointing at it.
        publish_state = publish_state and read_state(name) is None
        if publish_state:
            state_file(name).parent.mkdir(parents=True, exist_ok=True)
            state_file(name).write_text(json.dumps({**info.__dict__, "pid": os.getpid()}))
        yield postgres, kafka, info
    finally:
        if publish_state:
            state_file(name).unlink(missing_ok=True)
        kafka.stop()
        postgres.stop()
