"""How a service's handler is called: checked when it is registered, called in the shape it was written in.

A handler postbox cannot run must never be recorded as done. Calling an `async def` function, a generator
function or an async generator function runs none of its body: it only returns an object. So every
handler (and every after_commit hook) is checked when it is registered, and called here, one way:

- a `def` handler is called with the psycopg `Connection` whose transaction claimed the message;
- an `async def` handler is awaited, with a psycopg `AsyncConnection` on the same session, so its
  statements are in that same transaction, on an event loop this caller owns (one per consumer thread);
- anything else is refused at registration (`TypeError`), and a `def` that still hands back an awaitable
  or a generator (a wrapper around an async function, say) fails with `HandlerNotRun`, a permanent
  failure: the message is parked with that reason, never recorded as done.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import psycopg


class HandlerNotRun(Exception):
    """A handler's call returned an object instead of running its body (an awaitable or a generator)."""


def is_async(function: Callable[..., Any]) -> bool:
    """Whether calling `function` gives a coroutine to await (an `async def`, a partial of one, or an
    object whose __call__ is one)."""
    if inspect.iscoroutinefunction(function):
        return True
    call = getattr(function, "__call__", None)  # noqa: B004  (an instance with an async __call__)
    return not inspect.isroutine(function) and call is not None and inspect.iscoroutinefunction(call)


def check_callable(function: object, what: str, arguments: int) -> None:
    """Refuse, at registration, what the caller could not run: not callable, a generator or async generator
    function (its body would never run), or a signature that does not take `arguments` positional ones."""
    if not callable(function):
        raise TypeError(f"{what}: {function!r} is not callable")
    for test, kind in (
        (inspect.isgeneratorfunction, "a generator function"),
        (inspect.isasyncgenfunction, "an async generator function"),
    ):
        if test(function) or test(getattr(function, "__call__", None)):  # noqa: B004
            raise TypeError(f"{what}: {_name(function)} is {kind}; calling it would not run its body")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: it is called and judged then
        return
    try:
        signature.bind(*([None] * arguments))
    except TypeError as exc:
        raise TypeError(
            f"{what}: {_name(function)}{signature} cannot take {arguments} arguments ({exc})"
        ) from None


def _name(function: object) -> str:
    return str(getattr(function, "__qualname__", None) or repr(function))


class HandlerCaller:
    """Calls handlers and hooks for one thread of a consumer or worker; close() when that thread is done."""

    def __init__(self) -> None:
        self._runner: asyncio.Runner | None = None
        # One AsyncConnection per psycopg Connection, for as long as that connection lives.
        self._twins: weakref.WeakKeyDictionary[psycopg.Connection[Any], psycopg.AsyncConnection[Any]] = (
            weakref.WeakKeyDictionary()
        )

    def with_transaction(
        self, function: Callable[..., Any], conn: psycopg.Connection[Any], *args: Any
    ) -> None:
        """Call a handler: `function(conn, *args)`, or for an async one `await function(async_conn, *args)`
        with `async_conn` on the same session (and so in the same transaction)."""
        if is_async(function):
            self._await(function, self._async_twin(conn), *args)
        else:
            self._not_an_object(function, function(conn, *args))

    def plain(self, function: Callable[..., Any], *args: Any) -> None:
        """Call a hook that takes no transaction, awaiting it when it is async."""
        if is_async(function):
            self._await(function, *args)
        else:
            self._not_an_object(function, function(*args))

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def _await(self, function: Callable[..., Any], *args: Any) -> None:
        if self._runner is None:
            check_no_running_loop()  # before the coroutine exists: refused, it is not left unawaited
            self._runner = asyncio.Runner()
        self._runner.run(function(*args))

    @staticmethod
    def _not_an_object(function: Callable[..., Any], result: object) -> None:
        if inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result):
            if inspect.iscoroutine(result):
                result.close()  # it never ran; closing it spares the "never awaited" warning
            raise HandlerNotRun(
                f"{_name(function)} returned {type(result).__name__} instead of running: declare it "
                "`async def` (postbox awaits those) or make it run its work when called"
            )

    def _async_twin(self, conn: psycopg.Connection[Any]) -> psycopg.AsyncConnection[Any]:
        twin = self._twins.get(conn)
        if twin is None:
            pgconn = conn.pgconn
            # Constructing a connection object takes over the session's notice and notify callbacks; the
            # psycopg Connection keeps them, so what the session says still reaches its owner.
            notice, notify = pgconn.notice_handler, pgconn.notify_handler
            twin = psycopg.AsyncConnection(pgconn)
            pgconn.notice_handler, pgconn.notify_handler = notice, notify
            # Both objects would name server-side prepared statements from their own counters: only one may.
            twin.prepare_threshold = None
            self._twins[conn] = twin
        return twin


def check_no_running_loop() -> None:
    """Async handlers are awaited on the consumer's own event loop, in its own thread; a thread that is
    already running a loop (a consumer called from inside `async def` code) would block that loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        "async handlers cannot be awaited from a thread that runs an event loop already: start the consumer "
        "in a thread of its own (for example `await asyncio.to_thread(consume, ...)`)"
    )
