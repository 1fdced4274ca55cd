"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on.

With `bridge/loop.py` (which tunes the loop `open_bridge()` opens), the only module that
knows trio-asyncio exists. Under trio, asyncio code runs in a
trio-asyncio loop: the host's own if it opened one (`trio_asyncio.open_loop()`), otherwise one
that `open_bridge()` opens for the trainer's lifetime. Under asyncio (`anyio.run(...)` with its
default backend) the same calls are plain awaits.

Cancellation crosses both ways: cancelling the trio side cancels the asyncio task (its
`finally` blocks run), and exceptions come back with their own type and traceback, except:

- `KeyboardInterrupt` and `SystemExit` come back as `_BaseExceptionEscaped`, an ordinary
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
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.lowlevel
import sniffio

from ...messages.errors import (
    AsyncioTaskCancelled,
    CallbackNotAwaitable,
    _BaseExceptionEscaped,
    self_cancelled,
)
from .default_executor import DefaultExecutor, default_executor_of
from .loop import (
    can_run_in_batches,
    can_run_in_executor_as_asyncio,
    keep_asyncio_loops_outside_trio,
    run_in_executor_as_asyncio,
    run_ready_handles_in_batches,
    see_trio_asyncio_loops,
)

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


def callable_name(fn: object) -> str:
    """How an error names the user's callable (or iterator)."""
    plain = fn.func if isinstance(fn, functools.partial) else fn
    return str(getattr(plain, "__qualname__", None) or type(plain).__qualname__)


async def await_callback(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user callback and await what it returns, as ART does.

    Anything callable that returns an awaitable is a callback: an `async def`, a lambda or
    `functools.partial` around one, an object with an async `__call__`. A result that cannot
    be awaited is a programming error, not a failed rollout: it raises CallbackNotAwaitable,
    which ends the run.
    """
    try:
        result = fn(*args, **kwargs)
        if not inspect.isawaitable(result):
            raise _not_awaitable(fn, result)
        return await result
    except (KeyboardInterrupt, SystemExit) as exc:
        # Inside an asyncio task it would end the event loop (see the module docstring).
        raise _BaseExceptionEscaped(exc) from exc


def _not_awaitable(fn: object, result: object) -> CallbackNotAwaitable:
    return CallbackNotAwaitable(
        f"{callable_name(fn)} returned {type(result).__name__}, which cannot be awaited; the "
        "trainer awaits every rollout_fn and eval_fn call, so make it an `async def` "
        "(or have it return a coroutine)"
    )


def _own_asyncio_cancellation() -> bool:
    """Under asyncio: is the current task being cancelled (by a cancel scope, a timeout)?

    A CancelledError the callback raised on its own leaves the task's cancel count at 0.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return False
    return task is None or task.cancelling() > 0


class Bridge:
    """Awaits asyncio coroutine functions from the trainer's loop."""

    #: True when asyncio code runs through trio-asyncio (the trainer runs under trio).
    uses_trio_asyncio: bool = False

    @property
    def asyncio_loop(self) -> asyncio.AbstractEventLoop | None:
        """The asyncio loop the bridged calls run on: the trio-asyncio loop under trio, None
        under asyncio (the running loop itself). The stall watchdog lists its tasks."""
        return None

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        """Await `fn(*args, **kwargs)`, an asyncio coroutine function, and return its result."""
        # Awaited in place, not through a helper coroutine: a frame more per rollout is
        # measurable at zero latency.
        try:
            return await fn(*args, **kwargs)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit) as exc:
            replacement = self._replacement(fn, exc)
            if replacement is None:
                raise
            raise replacement from exc

    async def callback(
        self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Await a user callback: natively if marked `trio_native`, else as asyncio code."""
        # Under asyncio both are awaited in place; _TrioAsyncioBridge bridges the asyncio ones.
        # `await_callback`, inlined: every frame between a worker and its rollout is resumed
        # each time the rollout yields.
        try:
            awaitable = fn(*args, **kwargs)
            if not inspect.isawaitable(awaitable):
                raise _not_awaitable(fn, awaitable)
            result: R = await awaitable
        except asyncio.CancelledError as exc:
            replacement = self._replacement(fn, exc)
            if replacement is None:
                raise
            raise replacement from exc
        except (KeyboardInterrupt, SystemExit) as exc:
            raise _BaseExceptionEscaped(exc) from exc
        return result

    async def callback_holding(
        self,
        hold: Callable[[], AbstractAsyncContextManager[Any]],
        fn: Callable[..., Awaitable[R]],
        *args: Any,
    ) -> R:
        """Await the user callback `fn(*args)` while the asyncio context manager `hold()` is
        entered, in the asyncio task that runs the callback, as ART does: what it sets in
        context reaches the callback and is reset in the task that set it."""

        async def held() -> R:
            async with hold():
                result: R = await await_callback(fn, *args)
                return result

        return await self.call(held)

    def _replacement(self, fn: object, exc: BaseException) -> BaseException | None:
        """The error to raise instead of `exc` (module docstring), or None to re-raise it."""
        if isinstance(exc, asyncio.CancelledError):
            return None if self._own_cancellation() else self_cancelled(fn)
        return _BaseExceptionEscaped(exc)

    def _own_cancellation(self) -> bool:
        # Under asyncio (this class), the trainer's cancellation is asyncio.CancelledError too.
        return _own_asyncio_cancellation()


async def _in_asyncio(fn: Callable[..., Awaitable[R]], args: Any, kwargs: Any) -> R:
    # `fn` is called here, inside the asyncio task: code that looks up the running asyncio
    # loop or task when called (not only when awaited) finds it.
    try:
        return await fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit) as exc:
        # Leaving the asyncio task as such would kill trio-asyncio's loop (module docstring).
        raise _BaseExceptionEscaped(exc) from exc


class _TrioAsyncioBridge(Bridge):
    uses_trio_asyncio = True

    def __init__(self, loop: Any) -> None:
        import outcome
        import trio

        self._loop = loop
        self._current_task = trio.lowlevel.current_task
        self._wait = trio.lowlevel.wait_task_rescheduled
        _Waiting._reschedule = staticmethod(trio.lowlevel.reschedule)
        _Waiting._capture = staticmethod(outcome.capture)
        _Waiting._abort_failed = trio.lowlevel.Abort.FAILED

    @property
    def asyncio_loop(self) -> asyncio.AbstractEventLoop | None:
        loop: asyncio.AbstractEventLoop = self._loop
        return loop

    def _own_cancellation(self) -> bool:
        # Under trio the trainer's cancellation is trio.Cancelled: asyncio.CancelledError
        # reaching trio-native code came from asyncio code, never from the trainer.
        return False

    async def call(self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(_in_asyncio(fn, args, kwargs), fn)

    async def callback(
        self, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        if is_native(fn):
            return await super().callback(fn, *args, **kwargs)
        # await_callback guards KeyboardInterrupt/SystemExit inside the asyncio task.
        return await self._run(await_callback(fn, *args, **kwargs), fn)

    async def callback_holding(
        self,
        hold: Callable[[], AbstractAsyncContextManager[Any]],
        fn: Callable[..., Awaitable[R]],
        *args: Any,
    ) -> R:
        if not is_native(fn):
            return await super().callback_holding(hold, fn, *args)
        # A trio-native callback cannot run inside an asyncio task, so `hold()` is entered
        # and left by an asyncio task of its own for the callback's duration. Context it
        # sets does not reach trio code.
        entered = anyio.Event()
        failed: list[BaseException] = []

        async def keep() -> None:
            async with hold():
                entered.set()
                await anyio.sleep_forever()

        async def holder() -> None:
            try:
                await self.call(keep)
            except Exception as exc:
                failed.append(exc)
                entered.set()

        outcome: list[R] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await entered.wait()
            try:
                if not failed:
                    outcome.append(await await_callback(fn, *args))
            except Exception as exc:
                failed.append(exc)
            finally:
                tg.cancel_scope.cancel()
        # Raised here, outside the task group, so callers see the callback's own exception.
        if failed:
            raise failed[0]
        return outcome[0]

    async def _run(self, coro: Coroutine[Any, Any, R], fn: object) -> R:
        # One asyncio task per call, awaited the way trio-asyncio's `run_aio_coroutine` does
        # (a trio cancel cancels the task and waits for it to end; CancelledError out of a
        # task the trio side cancelled becomes trio's Cancelled), minus its wrapper
        # coroutines and closures; see _Waiting for what the done callback does differently.
        try:
            task = self._loop.create_task(coro)
        except BaseException:
            coro.close()  # avoid a "never awaited" warning
            raise
        waiting = _Waiting(task, self._current_task())
        task.add_done_callback(waiting)
        try:
            result: R = await self._wait(waiting.abort)
        except asyncio.CancelledError as exc:
            if waiting.raise_cancel is not None:
                # The trio side cancelled the task and it ended cancelled: raise trio's own
                # Cancelled, chained to what the task raised.
                try:
                    waiting.raise_cancel()
                finally:
                    sys.exc_info()[1].__cause__ = exc  # type: ignore[union-attr]
            # When the trio side is being cancelled, this checkpoint raises trio's own
            # Cancelled, so shutdown is not mistaken for a failure of the callback.
            await anyio.lowlevel.checkpoint()
            raise AsyncioTaskCancelled(
                f"{getattr(fn, '__qualname__', fn)!s} was cancelled from inside asyncio "
                "(asyncio.CancelledError) while the trainer was still running"
            ) from exc
        return result


class _Waiting:
    """A trio task waiting for one asyncio task: the task's done callback and the trio abort.

    As the done callback (an instance of a class without `__dict__`, so the loop's
    coroutine-function check on it is remembered per type), it takes the outcome out of the
    asyncio task and drops the reference to it, so the task and its coroutines are freed in
    the loop step that finished them rather than when the trio caller next runs
    (benchmarks/README.md: fewer objects alive at once, fewer garbage collections).
    """

    __slots__ = ("raise_cancel", "task", "waiter")

    # Bound on first use under trio (`_TrioAsyncioBridge.__init__`): this module imports
    # neither trio nor outcome at import time.
    _reschedule: Callable[[Any, Any], None]
    _capture: Callable[..., Any]
    _abort_failed: Any

    def __init__(self, task: asyncio.Task[Any], waiter: Any) -> None:
        self.task: asyncio.Task[Any] | None = task
        self.waiter = waiter
        self.raise_cancel: Callable[[], Any] | None = None

    def __call__(self, finished: asyncio.Task[Any]) -> None:
        self.task = None
        self._reschedule(self.waiter, self._capture(finished.result))

    def abort(self, raise_cancel: Callable[[], Any]) -> Any:
        self.raise_cancel = raise_cancel
        if self.task is not None:
            self.task.cancel()
        return self._abort_failed  # keep waiting until the task has ended


@asynccontextmanager
async def open_bridge() -> AsyncIterator[Bridge]:
    """Yield the bridge for the running loop, opening a trio-asyncio loop only if needed.

    Blocking calls the asyncio code hands to the default executor run in daemon threads a
    cancel lets go (bridge/default_executor.py), under asyncio as on the loop opened here;
    those still running when the block ends, their callers cancelled, are named in a
    warning."""
    if sniffio.current_async_library() != "trio":
        with default_executor_of(asyncio.get_running_loop()) as executor:
            try:
                yield Bridge()
            finally:
                if executor is not None:
                    executor.report_abandoned()
        return
    # Imported only under trio: importing trio_asyncio patches asyncio process-wide. What of
    # it changes asyncio outside trio (every later asyncio.run on trio-asyncio's loop, 4-5x
    # slower: asyncio.sleep(0) 3 us -> 14 us here) is contained at once.
    import trio_asyncio

    keep_asyncio_loops_outside_trio()
    see_trio_asyncio_loops()
    loop = trio_asyncio.current_loop.get()
    if loop is not None:
        yield _TrioAsyncioBridge(loop)
        return
    executor = DefaultExecutor()
    try:
        async with trio_asyncio.open_loop() as loop:
            if can_run_in_batches(loop):
                run_ready_handles_in_batches(loop)
            if can_run_in_executor_as_asyncio(loop):
                run_in_executor_as_asyncio(loop, executor)
            yield _TrioAsyncioBridge(loop)
    finally:
        executor.report_abandoned()


async def call_asyncio_from_trio(fn: Callable[..., Awaitable[R]], *args: Any) -> R:
    """Await the asyncio coroutine function `fn(*args)` from trio code that runs inside the
    trainer's trio-asyncio loop (a trio_native callback wrapping a user's asyncio one, as
    art_trio.testing's harness does). The one door to trio-asyncio outside the bridge."""
    import trio_asyncio

    result: R = await trio_asyncio.aio_as_trio(fn)(*args)
    return result
