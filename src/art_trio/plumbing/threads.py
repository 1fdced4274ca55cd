"""Reaching a running trainer from another thread (an exporter, a watchdog).

The trainer's state belongs to its event loop's thread: the stages change it between
checkpoints, and `trio.current_time()` only works in the thread running `trio.run`. A call
from any other thread is therefore handed to the loop (`trio`'s token, or asyncio's
`call_soon_threadsafe`) and runs there between two tasks' steps, so what it reads is one
consistent instant of the run; the calling thread waits for the answer, for at most a timeout
(a loop blocked by a callback that never yields cannot answer, and a watchdog must learn that
rather than hang with it). The trainer hands calls over from the first line of `train()` to
its last, start-up included: a start-up's cancel scope and settings are the loop's too.

Every run makes a `LoopHandle`; the hand-off itself (`plumbing/handoff.py`) is loaded by the
first call from another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import sniffio

R = TypeVar("R")

#: How long a call from another thread waits for the loop by default, in seconds.
DEFAULT_TIMEOUT_S = 10.0


class LoopHandle:
    """The running loop's thread, and how to schedule a function onto it from elsewhere."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        #: What schedules onto the loop: trio's token for the run, or the asyncio loop.
        self.loop: Any
        if sniffio.current_async_library() == "trio":
            import trio

            self.loop = trio.lowlevel.current_trio_token()
        else:
            import asyncio

            self.loop = asyncio.get_running_loop()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread

    def call(self, fn: Callable[[], R], *, timeout: float | None, what: str) -> R:
        """`fn()` run in the loop's thread; its result or exception, here.

        Raises `_LoopClosed` if the loop ended first and `LoopUnresponsive` after `timeout`
        seconds (`fn` then never runs). `what` names the call in those errors.
        """
        from .handoff import call_in_loop

        return call_in_loop(self.loop, fn, timeout=timeout, what=what)
