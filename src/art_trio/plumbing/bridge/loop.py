"""The trio-asyncio loop the bridge runs asyncio code on: made visible to modules that
looked asyncio's loop up early (`see_trio_asyncio_loops`), kept from changing asyncio's loops
outside trio (`keep_asyncio_loops_outside_trio`), and, for the loop `open_bridge()` opens
itself, a plain ready queue run in batches (`run_ready_handles_in_batches`: what most of a
bridged call's cost was) and asyncio's own `run_in_executor` (`run_in_executor_as_asyncio`).
Set up once per loop; nothing here runs per call except the loop's own closures. Only
`bridge/calls.py` imports this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from typing import Any

import sniffio


def see_trio_asyncio_loops() -> None:
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


class _PolicyOutsideTrio:
    """trio-asyncio's record of the event loop policy set outside trio, kept for the whole
    process as asyncio keeps its policy, instead of per thread: never None, so trio-asyncio's
    policy always defers to it outside trio (`keep_asyncio_loops_outside_trio`)."""

    def __init__(self, policy: asyncio.AbstractEventLoopPolicy) -> None:
        self._policy: asyncio.AbstractEventLoopPolicy | None = policy
        self._lock = threading.Lock()

    @property
    def policy(self) -> asyncio.AbstractEventLoopPolicy:
        with self._lock:
            if self._policy is None:  # set_event_loop_policy(None): asyncio's default again
                self._policy = asyncio.DefaultEventLoopPolicy()
            return self._policy

    @policy.setter
    def policy(self, policy: asyncio.AbstractEventLoopPolicy | None) -> None:
        with self._lock:
            self._policy = policy


def keep_asyncio_loops_outside_trio() -> None:
    """Give asyncio code that runs outside trio asyncio's own event loops again, process-wide.

    Importing trio_asyncio (trio_asyncio/_loop.py) installs its `TrioPolicy` as asyncio's
    global policy and routes `asyncio.new_event_loop`, `get_event_loop`, `set_event_loop` and
    `get/set_event_loop_policy` through it. Inside trio it answers with trio-asyncio's loops,
    which the bridge needs. Outside trio it defers to a policy recorded per thread, and where
    a thread has recorded none (every thread that never called `set_event_loop_policy`) it
    makes trio-asyncio's `SyncTrioEventLoop`: every later `asyncio.run` and
    `anyio.run(backend="asyncio")` in the process ran on that loop (about twice the CPU, and
    only trio-asyncio's own executors accepted by `run_in_executor`). Here the record becomes
    one for the process that is never empty: the policy in force when trio_asyncio was
    imported until the program sets another, asyncio's default after
    `set_event_loop_policy(None)`; so outside trio, asyncio works as it does without
    trio_asyncio. The other functions the import replaced (`get_running_loop`,
    `current_task`) already behave as asyncio's own outside trio. Idempotent; a
    trio-asyncio without that record is left as it is.
    """
    from trio_asyncio import _loop as internals

    recorded = getattr(internals, "_faked_policy", None)
    if recorded is None or isinstance(recorded, _PolicyOutsideTrio):
        return
    original = getattr(internals, "_original_policy", None)
    policy = getattr(recorded, "policy", None) or original
    if not isinstance(policy, asyncio.AbstractEventLoopPolicy):
        return
    internals._faked_policy = _PolicyOutsideTrio(policy)


def run_in_executor_as_asyncio(loop: Any, default: concurrent.futures.ThreadPoolExecutor) -> None:
    """Give a trio-asyncio loop asyncio's own `run_in_executor`, with `default` as its
    default executor.

    trio-asyncio's accepts only its own `TrioExecutor` (any other executor fails a bare
    `assert`), and runs the call with `trio.to_thread.run_sync` without abandoning it on
    cancel, so cancelling `await asyncio.to_thread(f)` waited for `f`. asyncio's method
    submits to any `concurrent.futures.Executor` and stops waiting when the awaiting task is
    cancelled; `default` (bridge/default_executor.py) runs calls in daemon threads nothing
    joins. A `TrioExecutor` passed in, or made the default, keeps trio-asyncio's way.
    Applied only to a loop that has asyncio's executor internals.
    """
    from trio_asyncio import TrioExecutor

    stock = loop.run_in_executor

    def run_in_executor(executor: Any, func: Any, *args: Any) -> Any:
        chosen = loop._default_executor if executor is None else executor
        if isinstance(chosen, TrioExecutor):
            return stock(chosen, func, *args)
        return asyncio.BaseEventLoop.run_in_executor(loop, executor, func, *args)

    def set_default_executor(executor: Any) -> None:
        asyncio.BaseEventLoop.set_default_executor(loop, executor)

    loop._default_executor = default
    loop.run_in_executor = run_in_executor
    loop.set_default_executor = set_default_executor


def can_run_in_executor_as_asyncio(loop: Any) -> bool:
    return isinstance(loop, asyncio.BaseEventLoop) and all(
        hasattr(loop, name) for name in ("_default_executor", "_check_default_executor")
    )


#: Handles the loop runs in one batch at most before it yields to trio again (asyncio's own
#: loop runs every handle that is ready at the start of an iteration; this bounds how long
#: trio tasks wait behind a burst of asyncio work).
_HANDLES_PER_YIELD = 64


def run_ready_handles_in_batches(loop: Any) -> None:
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


def can_run_in_batches(loop: Any) -> bool:
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
