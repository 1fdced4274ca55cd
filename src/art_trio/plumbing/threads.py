"""Reaching a running trainer from another thread (an exporter, a watchdog).

The trainer's state belongs to its event loop's thread: the stages change it between
checkpoints, and `trio.current_time()` only works in the thread running `trio.run`. A call
from any other thread is therefore handed to the loop (`trio`'s token, or asyncio's
`call_soon_threadsafe`) and runs there between two tasks' steps, so what it reads is one
consistent instant of the run; the calling thread waits for the answer, for at most a timeout
(a loop blocked by a callback that never yields cannot answer, and a watchdog must learn that
rather than hang with it). The trainer hands calls over from the first line of `train()` to
its last, start-up included: a start-up's cancel scope and settings are the loop's too.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import sniffio

from ..messages.errors import LoopUnresponsive, _LoopClosed

R = TypeVar("R")

#: How long a call from another thread waits for the loop by default, in seconds.
DEFAULT_TIMEOUT_S = 10.0


def _as_asyncio(fn: Callable[[], None]) -> None:
    """`fn()` in an asyncio callback, declared to sniffio as asyncio code.

    A callback runs in no asyncio task, where sniffio (which anyio asks which loop it is on)
    finds no library and raises; the trainer's methods use anyio."""
    token = sniffio.current_async_library_cvar.set("asyncio")
    try:
        fn()
    finally:
        sniffio.current_async_library_cvar.reset(token)


class LoopHandle:
    """The running loop's thread, and how to schedule a function onto it from elsewhere."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        if sniffio.current_async_library() == "trio":
            import trio

            token = trio.lowlevel.current_trio_token()
            self._schedule: Callable[[Callable[[], None]], object] = token.run_sync_soon
            self._closed: tuple[type[BaseException], ...] = (trio.RunFinishedError,)
        else:
            import asyncio

            call_soon = asyncio.get_running_loop().call_soon_threadsafe

            def schedule(fn: Callable[[], None]) -> None:
                call_soon(_as_asyncio, fn)

            self._schedule = schedule
            self._closed = (RuntimeError,)  # "Event loop is closed"

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread

    def call(self, fn: Callable[[], R], *, timeout: float | None, what: str) -> R:
        """`fn()` run in the loop's thread; its result or exception, here.

        Raises `_LoopClosed` if the loop ended first and `LoopUnresponsive` after `timeout`
        seconds (`fn` then never runs). `what` names the call in those errors.
        """
        future: concurrent.futures.Future[R] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller gave up waiting: do nothing late
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001  (handed to the calling thread)
                future.set_exception(exc)

        try:
            self._schedule(run)
        except self._closed as exc:
            raise _LoopClosed(f"{what}: the trainer's event loop has ended") from exc
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if not future.cancel():
                return future.result()  # running or done after all: it answers now
            raise LoopUnresponsive(
                f"{what}: the trainer's event loop did not answer within {timeout:g} s. "
                "Something running on it is blocking it without yielding (a rollout_fn, "
                "eval_fn or observer doing blocking work?)"
            ) from None
