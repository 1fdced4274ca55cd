"""Where asyncio code's blocking calls run while the trainer runs it, so that a stop never
waits for one: `await asyncio.to_thread(f)`, `loop.run_in_executor(None, f)`.

A thread cannot be interrupted. asyncio's answer, when the awaiting task is cancelled, is to
stop waiting and let the thread finish on its own; but its default executor's threads are
then joined when the loop closes (`asyncio.run`, `anyio.run`) and again when the interpreter
exits, and trio-asyncio's default executor does not stop waiting at all (it runs
`trio.to_thread.run_sync` without `abandon_on_cancel`). Either way a stop or a failure
would wait for a call that may never return.

`DaemonExecutor` runs the blocking calls of the asyncio code the trainer runs, built on the
first one by the loop's default executor (bridge/default_executor.py). Cancelling the
awaiting task lets the call go at once, as in asyncio; the thread it runs in is a daemon
thread, which neither the loop's close nor the interpreter's exit waits for.
`report_abandoned` names, when `train()` ends, the calls whose callers gave up while they ran
and that still run.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import os
import threading
import warnings
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class _Future(concurrent.futures.Future[Any]):
    """A call's future that remembers being cancelled while it ran.

    asyncio cancels the concurrent future of `run_in_executor` when the awaiting task is
    cancelled; a running one cannot be, so that attempt is the moment its caller gave up."""

    abandoned = False

    def cancel(self) -> bool:
        if self.running():
            self.abandoned = True
        return super().cancel()


def _name(fn: Any, args: tuple[Any, ...]) -> str:
    """What a call runs, through the partial and `Context.run` `asyncio.to_thread` wraps."""
    while isinstance(fn, functools.partial):
        fn, args = fn.func, fn.args + args
    if isinstance(getattr(fn, "__self__", None), contextvars.Context) and args:
        return _name(args[0], args[1:])
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    return f"{module}.{qualname}" if module else qualname


@dataclass(eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str
    future: _Future = field(default_factory=_Future)
    reported: bool = False

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001  (the caller's to see, as in any executor)
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class DaemonExecutor(concurrent.futures.Executor):
    """Runs each call in one of trio's cached daemon threads, at most `max_workers` at once
    (asyncio's default executor's count by default), the others queued in order.

    The threads come from `trio.lowlevel.start_thread_soon`, which needs no trio run, so this
    works under asyncio as under trio. `shutdown(wait=True)` waits for the calls whose
    callers still wait.
    """

    def __init__(self, max_workers: int | None = None) -> None:
        if max_workers is None:
            max_workers = min(32, (os.cpu_count() or 1) + 4)
        self._max_workers = max_workers
        self._lock_calls = threading.Condition()
        self._queued: deque[_Call] = deque()
        self._started: set[_Call] = set()  # handed to a thread, not yet ended
        self._busy = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> _Future:
        call = _Call(fn, args, kwargs, _name(fn, args))
        with self._lock_calls:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._busy >= self._max_workers:
                self._queued.append(call)
                return call.future
            self._busy += 1
        self._start(call)
        return call.future

    def _start(self, call: _Call) -> None:
        import trio

        with self._lock_calls:
            self._started.add(call)
        try:
            trio.lowlevel.start_thread_soon(
                functools.partial(self._run, call), _ignore, name=f"art_trio: {call.name}"
            )
        except BaseException as exc:  # no thread could be started: the call fails, not the loop
            self._ended(call)
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(exc)
            self._next()

    def _run(self, call: _Call) -> None:
        try:
            call.run()
        finally:
            self._ended(call)
            self._next()

    def _ended(self, call: _Call) -> None:
        with self._lock_calls:
            self._started.discard(call)
            self._lock_calls.notify_all()

    def _next(self) -> None:
        with self._lock_calls:
            if not self._queued:
                self._busy -= 1
                return
            call = self._queued.popleft()
        self._start(call)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock_calls:
            self._closed = True
            if cancel_futures:
                while self._queued:
                    self._queued.popleft().future.cancel()
            if wait:
                self._lock_calls.wait_for(
                    lambda: all(call.future.done() for call in self._queued)
                    and all(call.future.abandoned for call in self._started)
                )

    def abandoned(self) -> list[str]:
        """The calls still running whose callers gave up, not named by an earlier call; each
        is named once."""
        with self._lock_calls:
            calls = [c for c in self._started if c.future.abandoned and not c.reported]
            for call in calls:
                call.reported = True
        return sorted(call.name for call in calls)


def _ignore(_: object) -> None:
    """`start_thread_soon` delivers the outcome of `_run`, which has handled it."""


def report_abandoned(executor: DaemonExecutor) -> None:
    """Warn, naming them, of calls left running in threads whose callers were cancelled."""
    names = executor.abandoned()
    if not names:
        return
    listed = ", ".join(
        name if count == 1 else f"{name} (x{count})" for name, count in Counter(names).items()
    )
    warnings.warn(
        f"train() ends leaving {len(names)} blocking call(s) running in threads: {listed}. "
        "The asyncio code awaiting them was cancelled (a stop or a failure), and a thread "
        "cannot be interrupted: each finishes on its own, in a daemon thread that nothing "
        "waits for, its result dropped.",
        RuntimeWarning,
        stacklevel=1,
    )
