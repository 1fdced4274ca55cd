"""The default executor of the asyncio code the trainer runs: on the trio-asyncio loop the
bridge opens, and on the host's asyncio loop for the duration of `train()`
(`default_executor_of`).

It runs nothing itself. The first blocking call handed to it (`await asyncio.to_thread(f)`,
`loop.run_in_executor(None, f)`) builds the `DaemonExecutor` of bridge/blocking.py, which says
why such calls run in daemon threads, and every call goes there from then on: a run whose
asyncio code makes no blocking call never loads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .blocking import DaemonExecutor

_MISSING = object()


class DefaultExecutor(concurrent.futures.ThreadPoolExecutor):
    """Hands each call to a `DaemonExecutor` built on the first one.

    A `ThreadPoolExecutor` by type only, because asyncio's `set_default_executor` accepts no
    other type: it never starts a thread of its own.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self._daemons: DaemonExecutor | None = None
        # The first call may come from any thread that holds the executor, not only the loop's.
        self._building = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        daemons = self._daemons or self._build()
        return daemons.submit(fn, *args, **kwargs)

    def _build(self) -> DaemonExecutor:
        with self._building:
            if self._daemons is None:
                if self._closed:
                    raise RuntimeError("cannot schedule new futures after shutdown")
                from .blocking import DaemonExecutor

                self._daemons = DaemonExecutor()
            return self._daemons

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._building:
            self._closed = True
            daemons = self._daemons
        if daemons is not None:
            daemons.shutdown(wait, cancel_futures=cancel_futures)

    def report_abandoned(self) -> None:
        """Warn, naming them, of calls left running in threads whose callers were cancelled
        (bridge/blocking.py); a run that made no blocking call has none."""
        if self._daemons is not None:
            from .blocking import report_abandoned

            report_abandoned(self._daemons)


@dataclass(eq=False)
class _Lent:
    executor: DefaultExecutor
    previous: Any
    users: int = 0


#: The asyncio loops whose default executor is a DefaultExecutor while trainers run on them.
_lent: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Lent] = (
    weakref.WeakKeyDictionary()
)


@contextmanager
def default_executor_of(loop: asyncio.AbstractEventLoop) -> Iterator[DefaultExecutor | None]:
    """Make a `DefaultExecutor` the default executor of the host's asyncio `loop` while the
    block runs, then give back the one it had (None if there was none yet). Trainers on the
    same loop share one.

    Yields None, changing nothing, on a loop that does not keep its default executor where
    asyncio's loops do (uvloop's, a trio-asyncio loop the host opened): its own rules hold.
    """
    lent = _lent.get(loop)
    if lent is None:
        previous = getattr(loop, "_default_executor", _MISSING)
        if previous is _MISSING or type(loop).__module__.startswith("trio_asyncio"):
            yield None
            return
        lent = _lent[loop] = _Lent(DefaultExecutor(), previous)
        loop.set_default_executor(lent.executor)
    lent.users += 1
    try:
        yield lent.executor
    finally:
        lent.users -= 1
        if lent.users == 0:
            del _lent[loop]
            # Given back only if still ours (the host may have set another meanwhile); the
            # attribute itself, since set_default_executor accepts no None.
            if getattr(loop, "_default_executor", None) is lent.executor:
                loop._default_executor = lent.previous  # type: ignore[attr-defined]
            lent.executor.shutdown(wait=False)
