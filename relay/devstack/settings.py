"""Settings of `postbox dev ...` (the local stack and the demo). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from postbox.relay.core.settings import Settings, setting, shared_schema
from postbox.relay.devstack.stack import check_stack_name


def _stack_name(value: str) -> str:
    try:
        return check_stack_name(value)
    except ValueError:
        raise ValueError("is not 1-40 of A-Z a-z 0-9 _ -") from None


@dataclass(frozen=True, kw_only=True)
class StackChoice(Settings):
    """`postbox dev env`: which stack to answer for."""

    PREFIX: ClassVar[str] = "POSTBOX_DEV_"

    name: str = setting(
        "default",
        "the stack's name (as `postbox dev up --name` gave it)",
        parse=_stack_name,
        env="POSTBOX_DEV_STACK",
    )


@dataclass(frozen=True, kw_only=True)
class StackSettings(StackChoice):
    """`postbox dev up`."""

    postgres: str = setting(
        "auto", "which PostgreSQL binaries: auto, embedded, system", choices=("auto", "embedded", "system")
    )
    kafka_nodes: int = setting(1, "Kafka nodes (1, or 3 for a quorum)", bounds=(1, 3))
    schema: str = shared_schema()


@dataclass(frozen=True, kw_only=True)
class DemoSettings(Settings):
    """`postbox dev demo`."""

    PREFIX: ClassVar[str] = "POSTBOX_DEMO_"

    duration: float = setting(30.0, "seconds to run (0: until Ctrl-C)", bounds=(0, 1e9))
    rate: float = setting(5.0, "orders written per second", bounds=(0.1, 10_000))
