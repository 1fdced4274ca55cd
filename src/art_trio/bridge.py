"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on.

This is the only module that knows trio-asyncio exists. Under trio, asyncio code runs in a
trio-asyncio loop: the host's own if it opened one (`trio_asyncio.open_loop()`), otherwise one
that `open_bridge()` opens for the trainer's lifetime. Under asyncio (`anyio.run(...)` with its
default backend) the same calls are plain awaits.

Cancellation crosses both ways: cancelling the trio side cancels the asyncio task (its
`finally` blocks run), and exceptions come back with their own type and traceback, except:

- `KeyboardInterrupt` and `SystemExit` come back as `BaseExceptionEscaped`, an ordinary
  exception, so the run ends like any failure (stages cancelled, state saved) and `train()`
  re-raises the original. Raised as such inside an asyncio task they would end the event
  loop: trio-asyncio's loop dies with its futures unresolved and every task waiting on them
  hangs for good (no cancel scope or signal ends it); asyncio's loop stops mid-step.
- an `asyncio.CancelledError` that the callback raised itself, while the trainer was not
  cancelling it, comes back as `AsyncioTaskCancelled`: under asyncio it would otherwise be
  taken for the trainer's own cancellation and end a task group silently.
"""

from __future__ import annotations

import asyncio
import functools
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


class AsyncioTaskCancelled(RuntimeError):
    """Asyncio code cancelled itself while the trainer was not being cancelled."""


class BaseExceptionEscaped(Exception):  # noqa: N818  (it carries, it is not the error)
    """A KeyboardInterrupt or SystemExit raised by a callback, carried as an ordinary exception.

    The stages treat it as a failure (so everything is cancelled and the state is saved);
    `train()` then re-raises `original` itself.
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__} raised in a callback: {original}")
        self.original = original


def _own_asyncio_cancellation() -> bool:
    """Under asyncio: is the current task being cancelled (by a cancel scope, a timeout)?

    A CancelledError the callback raised on its own leaves the task's cancel count at 0.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return False
    return task is None or task.cancelling() > 0


def _self_cancelled(fn: object, exc: BaseException) -> AsyncioTaskCancelled:
    return AsyncioTaskCancelled(
        f"{getattr(fn, '__qualname__', fn)!s} raised asyncio.CancelledError while the trainer "
        "was not cancelling it (asyncio code cancelled itself)"
    )


class Bridge:
    """Awaits asyncio coroutine functions from the trainer's loop."""

    #: True when asyncio code runs through trio-asyncio (the trainer runs under trio).
    uses_trio_asyncio: bool = False

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        """Await `fn(*args, **kwargs)`, an asyncio coroutine function, and return its result."""
        # Awaited in place, not through a helper coroutine: a frame more per rollout is
        # measurable at zero latency. The two exceptions of the module docstring are turned
        # into errors here (and in `callback`).
        try:
            return await fn(*args, **kwargs)
        except asyncio.CancelledError as exc:
            if self._own_cancellation():
                raise
            raise _self_cancelled(fn, exc) from exc
        except (KeyboardInterrupt, SystemExit) as exc:
            raise BaseExceptionEscaped(exc) from exc

    async def callback(
        self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Await a user callback: natively if marked `trio_native`, else as asyncio code."""
        if not is_native(fn):
            return await self.call(fn, *args, **kwargs)
        try:
            return await fn(*args, **kwargs)
        except asyncio.CancelledError as exc:
            if self._own_cancellation():
                raise
            raise _self_cancelled(fn, exc) from exc
        except (KeyboardInterrupt, SystemExit) as exc:
            raise BaseExceptionEscaped(exc) from exc

    def _own_cancellation(self) -> bool:
        # Under asyncio (this class), the trainer's cancellation is asyncio.CancelledError too.
        return _own_asyncio_cancellation()


class _TrioAsyncioBridge(Bridge):
    uses_trio_asyncio = True

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    def _own_cancellation(self) -> bool:
        # Under trio the trainer's cancellation is trio.Cancelled: asyncio.CancelledError
        # reaching trio-native code came from asyncio code, never from the trainer.
        return False

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        import trio_asyncio

        async def guarded() -> R:
            # Runs inside the asyncio task: KeyboardInterrupt or SystemExit leaving it would
            # kill trio-asyncio's loop (see the module docstring).
            try:
                return await fn(*args, **kwargs)
            except (KeyboardInterrupt, SystemExit) as exc:
                raise BaseExceptionEscaped(exc) from exc

        try:
            result: R = await trio_asyncio.aio_as_trio(guarded, loop=self._loop)()
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
    """Make modules that imported asyncio.get_running_loop early see trio-asyncio's loops.

    trio-asyncio replaces `asyncio.get_running_loop` when it is imported. A module that did
    `from asyncio import get_running_loop` before that keeps the original, which does not know
    trio-asyncio's loop: anyio's asyncio backend is one, and through it httpx and openai then
    fail inside the bridge with "no running event loop" (pytest's anyio plugin imports it
    first, for instance). Rebinding its name to the patched function fixes that; the patched
    function behaves exactly like the original outside trio-asyncio.
    """
    anyio_asyncio = sys.modules.get("anyio._backends._asyncio")
    patched = asyncio.get_running_loop
    if anyio_asyncio is None:
        return
    if getattr(anyio_asyncio, "get_running_loop", patched) is not patched:
        setattr(anyio_asyncio, "get_running_loop", patched)  # noqa: B010  (module global)


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
    "BaseExceptionEscaped",
    "Bridge",
    "is_native",
    "open_bridge",
    "trio_native",
]
