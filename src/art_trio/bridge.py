"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on.

This is the only module that knows trio-asyncio exists. Under trio, asyncio code runs in a
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

from .errors import AsyncioTaskCancelled, CallbackNotAwaitable, _BaseExceptionEscaped

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
    try:
        result = fn(*args, **kwargs)
        if not inspect.isawaitable(result):
            raise CallbackNotAwaitable(
                f"{_name(fn)} returned {type(result).__name__}, which cannot be awaited; the "
                "trainer awaits every rollout_fn and eval_fn call, so make it an `async def` "
                "(or have it return a coroutine)"
            )
        return await result
    except (KeyboardInterrupt, SystemExit) as exc:
        # Inside an asyncio task it would end the event loop (see the module docstring).
        raise _BaseExceptionEscaped(exc) from exc


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
        try:
            result: R = await await_callback(fn, *args, **kwargs)
        except asyncio.CancelledError as exc:
            replacement = self._replacement(fn, exc)
            if replacement is None:
                raise
            raise replacement from exc
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
            return None if self._own_cancellation() else _self_cancelled(fn, exc)
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


#: Handles the loop runs in one batch at most before it yields to trio again (asyncio's own
#: loop runs every handle that is ready at the start of an iteration; this bounds how long
#: trio tasks wait behind a burst of asyncio work).
_HANDLES_PER_YIELD = 64


def _run_ready_handles_in_batches(loop: Any) -> None:
    """Give a trio-asyncio loop a plain ready queue, run in batches like asyncio's own loop.

    Stock trio-asyncio sends every asyncio callback (`call_soon`: a task's step, a future's
    done callbacks) through a trio memory channel, and its main loop receives them one at a
    time, each in its own `_main_loop_one` call with a cancel scope and a trio checkpoint:
    two or three per bridged call, most of the ~40 us a rollout paid to cross into asyncio
    (benchmarks/README.md). Here `call_soon` appends to a deque, as asyncio's loop does, and
    the main loop runs the handles ready at the start of a batch (at most
    `_HANDLES_PER_YIELD`) in one go, then yields to trio once (a checkpoint, so trio tasks
    and timers are never starved). Only when the deque is empty, or a timer is due, does it
    take the stock path (which blocks on the channel, pops due timers). Timers,
    `call_soon_threadsafe` and trio tasks started from asyncio (`AsyncHandle`) still travel
    on the channel; what waits there is moved to the deque at every batch, so nothing is
    left behind while the deque keeps filling. A sentinel (a cancelled handle, which the stock
    path skips) wakes the main loop when it sleeps on the channel. The shutdown drain
    (`no_wait=True`) runs the deque, then ends on the stock path's WouldBlock.

    Applied only to the loop `open_bridge()` opens itself, never to a host's loop, and only
    when the loop has the internals it relies on (else the stock loop runs unchanged).
    """
    import heapq
    from collections import deque

    import trio
    from trio_asyncio._handles import AsyncHandle

    stock = loop._main_loop_one
    stock_queue = loop._queue_handle
    receive_nowait = loop._q_recv.receive_nowait
    send_nowait = loop._q_send.send_nowait
    timers = loop._timers
    sniffio_library = sniffio.thread_local
    checkpoint = trio.lowlevel.cancel_shielded_checkpoint
    handle_type = asyncio.Handle
    ready: deque[asyncio.Handle] = deque()
    append = ready.append
    popleft = ready.popleft
    # Is the main loop (about to be) blocked on the channel? At first, yes: the loop is
    # already running, waiting in the stock `_main_loop_one` this replaces.
    sleeping = True
    wake = asyncio.Handle(lambda: None, (), loop)
    wake.cancel()

    def enqueue(handle: asyncio.Handle) -> asyncio.Handle:
        nonlocal sleeping
        if loop._closed:
            raise RuntimeError("Event loop is closed")
        append(handle)
        if sleeping:
            sleeping = False
            send_nowait(wake)
        return handle

    def queue_handle(handle: Any) -> Any:
        if type(handle) is handle_type:
            return enqueue(handle)
        return stock_queue(handle)  # timers and AsyncHandles: the channel, as stock

    def call_soon(callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
        check_callback(callback, "call_soon")
        return enqueue(handle_type(callback, args, loop, context))

    def take_from_channel() -> None:
        while True:
            try:
                handle = receive_nowait()
            except trio.WouldBlock:
                return
            if isinstance(handle, asyncio.TimerHandle):
                heapq.heappush(timers, handle)
            else:
                append(handle)

    async def main_loop_one(no_wait: bool = False) -> None:
        nonlocal sleeping
        take_from_channel()
        if not ready or (timers and timers[0]._when <= loop.time()):
            sleeping = not no_wait
            try:
                await stock(no_wait)
            finally:
                sleeping = False
            return
        previous, sniffio_library.name = sniffio_library.name, "asyncio"
        try:
            for _ in range(min(len(ready), _HANDLES_PER_YIELD)):
                handle = popleft()
                if isinstance(handle, AsyncHandle):
                    # Starting a trio task: the stock way, then end the batch.
                    sniffio_library.name = previous
                    await start_async_handle(handle)
                    return
                if not handle._cancelled:
                    handle._run()
        finally:
            sniffio_library.name = previous
        await checkpoint()

    async def start_async_handle(handle: Any) -> None:
        handle._context.run(loop._nursery.start_soon, handle._run, name=handle._callback)
        await handle._started.wait()

    # trio-asyncio checks every callback it queues for being a coroutine function (asyncio
    # does so only in debug mode); for C callables (an asyncio task's step, builtin methods)
    # and instances of classes without a __dict__ (the bridge's own done callback), the
    # answer depends on the type alone: remember it.
    stock_check = loop._check_callback
    plain_types: set[type] = set()

    def check_callback(callback: Any, method: str) -> None:
        kind = type(callback)
        if kind in plain_types:
            return
        stock_check(callback, method)
        if not hasattr(callback, "__dict__"):
            plain_types.add(kind)

    loop._main_loop_one = main_loop_one
    loop._check_callback = check_callback
    loop._queue_handle = queue_handle
    loop.call_soon = call_soon


def _can_run_in_batches(loop: Any) -> bool:
    try:
        from trio_asyncio._handles import AsyncHandle  # noqa: F401
    except ImportError:
        return False
    return all(
        hasattr(loop, name)
        for name in (
            "_main_loop_one",
            "_check_callback",
            "_queue_handle",
            "_q_recv",
            "_q_send",
            "_timers",
            "_nursery",
            "_closed",
        )
    ) and hasattr(sniffio, "thread_local")


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
        if _can_run_in_batches(loop):
            _run_ready_handles_in_batches(loop)
        yield _TrioAsyncioBridge(loop)


async def call_asyncio_from_trio(fn: Callable[..., Awaitable[R]], *args: Any) -> R:
    """Await the asyncio coroutine function `fn(*args)` from trio code that runs inside the
    trainer's trio-asyncio loop (a trio_native callback wrapping a user's asyncio one, as
    art_trio.testing's harness does). The one door to trio-asyncio outside this module."""
    import trio_asyncio

    result: R = await trio_asyncio.aio_as_trio(fn)(*args)
    return result


__all__ = [
    "AsyncioTaskCancelled",
    "Bridge",
    "CallbackNotAwaitable",
    "await_callback",
    "call_asyncio_from_trio",
    "is_native",
    "open_bridge",
    "trio_native",
]
