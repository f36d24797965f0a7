"""inbox.calling and the registration checks, without servers: every handler shape a service can pass is
either run or refused when it is registered; none is recorded done without its body running."""

from __future__ import annotations

import asyncio
import functools
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel

from postbox.inbox import Inbox, Message
from postbox.inbox.calling import HandlerCaller, HandlerNotRun, check_callable, is_async
from postbox.inbox.handlers import PayloadMismatch, decode_payload
from postbox.inbox.webhooks.worker import Webhooks


def message(value: bytes | None = b'{"account": "a", "amount": 3}') -> Message:
    return Message("t", 0, 1, b"k", value, {}, "id-1", "E")


async def async_handler(tx: Any, m: Message) -> None: ...


def sync_handler(tx: Any, m: Message) -> None: ...


class AsyncCallable:
    async def __call__(self, tx: Any, m: Message) -> None: ...


def test_async_handlers_are_recognised_in_every_shape() -> None:
    assert is_async(async_handler)
    assert is_async(functools.partial(async_handler))
    assert is_async(AsyncCallable())
    assert not is_async(sync_handler)
    assert not is_async(lambda tx, m: None)


def generator_handler(tx: Any, m: Message) -> Any:
    yield


async def async_generator_handler(tx: Any, m: Message) -> Any:
    yield


def one_argument(tx: Any) -> None: ...


@pytest.mark.parametrize(
    ("function", "said"),
    [
        (42, "is not callable"),
        (generator_handler, "is a generator function; calling it would not run its body"),
        (async_generator_handler, "is an async generator function"),
        (one_argument, "cannot take 2 arguments"),
    ],
)
def test_a_handler_that_cannot_run_is_refused_when_it_is_registered(function: Any, said: str) -> None:
    inbox, hooks = Inbox("svc"), Webhooks()
    with pytest.raises(TypeError, match=said):
        inbox.handler("E")(function)
    with pytest.raises(TypeError, match=said):
        inbox.fallback(function)
    with pytest.raises(TypeError, match=said):
        hooks.handler("stripe", "x")(function)
    assert inbox.handler_for(message()) is None, "nothing was registered"


def test_an_after_commit_hook_must_take_the_list_of_messages() -> None:
    with pytest.raises(TypeError, match=r"after_commit hook: .* cannot take 1 arguments"):
        Inbox("svc").after_commit(sync_handler)  # type: ignore[arg-type]


def test_handlers_with_defaults_and_star_args_are_accepted() -> None:
    inbox = Inbox("svc")
    inbox.handler("A")(lambda *args: None)
    inbox.handler("B")(lambda tx, m, extra=1: None)
    inbox.handler("C")(AsyncCallable())
    assert inbox.awaits()
    assert not Inbox("plain").awaits()


def test_an_async_handler_is_awaited_and_a_sync_one_called() -> None:
    ran: list[str] = []

    async def hook(messages: list[Message]) -> None:
        await asyncio.sleep(0)  # suspends once (no time passes), as a real coroutine would
        ran.append("async")

    calls = HandlerCaller()
    try:
        calls.plain(hook, [])
        calls.plain(lambda messages: ran.append("sync"), [])
        calls.plain(hook, [])  # the same loop, again
    finally:
        calls.close()
    assert ran == ["async", "sync", "async"]


def test_a_def_that_returns_a_coroutine_fails_as_not_run_and_the_coroutine_is_closed() -> None:
    ran: list[int] = []

    async def work() -> None:
        ran.append(1)

    def wrapper(messages: list[Message]) -> Any:
        return work()  # a sync wrapper around async work: calling it runs nothing

    calls = HandlerCaller()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be a RuntimeWarning
        with pytest.raises(HandlerNotRun, match="returned coroutine instead of running"):
            calls.plain(wrapper, [])
    assert ran == []


def test_async_handlers_refuse_a_thread_that_runs_an_event_loop_already() -> None:
    async def hook(messages: list[Message]) -> None: ...

    async def inside_a_loop() -> None:
        calls = HandlerCaller()
        with pytest.raises(RuntimeError, match="start the consumer in a thread of its own"):
            calls.plain(hook, [])

    asyncio.run(inside_a_loop())


class Deposit(BaseModel):
    account: str
    amount: int


@dataclass
class DepositRecord:
    account: str
    amount: int


def test_a_payload_decodes_to_the_type_its_handler_asks_for() -> None:
    assert decode_payload(message(), Deposit).payload == Deposit(account="a", amount=3)
    assert decode_payload(message(), DepositRecord).payload == DepositRecord("a", 3)
    original = message()
    decode_payload(original, Deposit)
    assert original.payload == {"account": "a", "amount": 3}, "the message itself is left as it was"


@pytest.mark.parametrize(
    ("value", "payload_type", "said"),
    [
        (b'{"account": "a", "amount": "lots"}', Deposit, "payload is not a Deposit: 1 validation error"),
        (b'{"account": "a"}', DepositRecord, "payload is not a DepositRecord: .*amount"),
        (b'{"account": "a", "amount": 1, "x": 0}', DepositRecord, "payload is not a DepositRecord: .*'x'"),
        (b"[1, 2]", DepositRecord, "payload is not a DepositRecord: a JSON object is needed, not list"),
        (b"\xff not json", Deposit, "payload is not JSON, so not a Deposit"),
        (None, DepositRecord, "a JSON object is needed, not NoneType"),
    ],
)
def test_a_payload_that_does_not_fit_fails_permanently_with_why(
    value: bytes | None, payload_type: type[Any], said: str
) -> None:
    with pytest.raises(PayloadMismatch, match=said):
        decode_payload(message(value), payload_type)


def test_a_payload_type_that_is_neither_a_model_nor_a_dataclass_is_refused() -> None:
    with pytest.raises(TypeError, match="neither a pydantic v2 model nor a dataclass"):
        Inbox("svc").handler("E", payload_type=dict)
    check_callable(sync_handler, "handler", 2)  # and a plain one passes
