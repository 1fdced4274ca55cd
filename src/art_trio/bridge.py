"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on.

This is the only module that knows trio-asyncio exists. Under trio, asyncio code runs in a
trio-asyncio loop: the host's own if it opened one (`trio_asyncio.open_loop()`), otherwise one
that `open_bridge()` opens for the trainer's lifetime. Under asyncio (`anyio.run(...)` with its
default backend) the same calls are plain awaits.

Cancellation crosses both ways: cancelling the trio side cancels the asyncio task (its
`finally` blocks run), and exceptions come back with their own type and traceback.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.lowlevel
import sniffio

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_NATIVE_ATTR = "__art_trio_native__"


def trio_native(fn: F) -> F:
    """Mark an async callback as trio/anyio-native: the trainer awaits it directly.

    By default art_trio treats `rollout_fn`, `eval_fn` and the single-rollout functions given
    to `make_group_rollout_fn` as asyncio code (what ART users have written), and under trio
    runs them through trio-asyncio. A function marked with this decorator must use only trio
    or anyio APIs; it then runs in the trainer's own task with no bridge, on either loop if it
    sticks to anyio.
    """
    setattr(fn, _NATIVE_ATTR, True)
    return fn


def is_native(fn: object) -> bool:
    """Whether `fn` was marked with `trio_native` (directly or through functools.partial)."""
    while True:
        if getattr(fn, _NATIVE_ATTR, False):
            return True
        if isinstance(fn, functools.partial):
            fn = fn.func
            continue
        return False


class CallbackNotAwaitable(TypeError):
    """A user callback returned something that cannot be awaited: the run cannot go on."""


def _name(fn: object) -> str:
    plain = fn.func if isinstance(fn, functools.partial) else fn
    return str(getattr(plain, "__qualname__", None) or type(plain).__qualname__)


async def await_callback(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user callback and await what it returns, as ART does.

    Anything callable that returns an awaitable is a callback: an `async def`, a lambda or
    `functools.partial` around one, an object with an async `__call__`. A result that cannot
    be awaited is a programming error, not a failed rollout: it raises CallbackNotAwaitable,
    which ends the run.
    """
    result = fn(*args, **kwargs)
    if not inspect.isawaitable(result):
        raise CallbackNotAwaitable(
            f"{_name(fn)} returned {type(result).__name__}, which cannot be awaited; the "
            "trainer awaits every rollout_fn and eval_fn call, so make it an `async def` "
            "(or have it return a coroutine)"
        )
    return await result


class AsyncioTaskCancelled(RuntimeError):
    """Asyncio code cancelled itself while the trainer was not being cancelled."""


class Bridge:
    """Awaits asyncio coroutine functions from the trainer's loop."""

    #: True when asyncio code runs through trio-asyncio (the trainer runs under trio).
    uses_trio_asyncio: bool = False

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        """Await `fn(*args, **kwargs)`, an asyncio coroutine function, and return its result."""
        return await fn(*args, **kwargs)

    async def callback(
        self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Await a user callback: natively if marked `trio_native`, else as asyncio code."""
        if is_native(fn):
            result: R = await await_callback(fn, *args, **kwargs)
            return result
        return await self.call(await_callback, fn, *args, **kwargs)


class _TrioAsyncioBridge(Bridge):
    uses_trio_asyncio = True

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        import trio_asyncio

        bound = functools.partial(fn, *args, **kwargs)
        try:
            result: R = await trio_asyncio.aio_as_trio(bound, loop=self._loop)()
        except asyncio.CancelledError as exc:
            # When the trio side is being cancelled, this checkpoint raises trio's own
            # Cancelled, so shutdown is not mistaken for a failure of the callback.
            await anyio.lowlevel.checkpoint()
            raise AsyncioTaskCancelled(
                f"{getattr(fn, '__qualname__', fn)!s} was cancelled from inside asyncio "
                "(asyncio.CancelledError) while the trainer was still running"
            ) from exc
        return result


def _see_trio_asyncio_loops() -> None:
    """Make modules that imported asyncio's loop lookups early see trio-asyncio's loops.

    trio-asyncio replaces `asyncio.get_running_loop` and `asyncio.current_task` when it is
    imported. A module that did `from asyncio import get_running_loop, current_task` before
    that keeps the originals, which do not know trio-asyncio's loop: anyio's asyncio backend
    is one, and through it httpx and openai then fail inside the bridge with "no running
    event loop" (pytest's anyio plugin imports it first, for instance; on Python 3.12 the
    C `current_task` fails the same way when httpx closes its pool). Rebinding those names to
    the patched functions fixes that; outside trio-asyncio they behave as the originals.
    """
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    if anyio_asyncio is None:
        return
    for name in ("get_running_loop", "current_task"):
        patched = getattr(asyncio, name)
        if getattr(anyio_asyncio, name, patched) is not patched:
            setattr(anyio_asyncio, name, patched)


@asynccontextmanager
async def open_bridge() -> AsyncIterator[Bridge]:
    """Yield the bridge for the running loop, opening a trio-asyncio loop only if needed."""
    if sniffio.current_async_library() != "trio":
        yield Bridge()
        return
    # Imported only under trio: importing trio_asyncio patches asyncio globally, which makes
    # plain asyncio several times slower (asyncio.sleep(0): 2 us -> 12 us here).
    import trio_asyncio

    _see_trio_asyncio_loops()
    loop = trio_asyncio.current_loop.get()
    if loop is not None:
        yield _TrioAsyncioBridge(loop)
        return
    async with trio_asyncio.open_loop() as loop:
        yield _TrioAsyncioBridge(loop)


__all__ = [
    "AsyncioTaskCancelled",
    "Bridge",
    "CallbackNotAwaitable",
    "await_callback",
    "is_native",
    "open_bridge",
    "trio_native",
]
