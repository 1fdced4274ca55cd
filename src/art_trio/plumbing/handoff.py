"""A call from another thread handed to the trainer's event loop, and its answer waited for
(plumbing/threads.py says why). Loaded by the first such call: most runs make none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import sniffio

from ..messages.errors import LoopUnresponsive, _LoopClosed

R = TypeVar("R")


def _as_asyncio(fn: Callable[[], None]) -> None:
    """`fn()` in an asyncio callback, declared to sniffio as asyncio code.

    A callback runs in no asyncio task, where sniffio (which anyio asks which loop it is on)
    finds no library and raises; the trainer's methods use anyio."""
    token = sniffio.current_async_library_cvar.set("asyncio")
    try:
        fn()
    finally:
        sniffio.current_async_library_cvar.reset(token)


def call_in_loop(loop: Any, fn: Callable[[], R], *, timeout: float | None, what: str) -> R:
    """`fn()` run on `loop` (trio's token for a run, or an asyncio loop); its result or
    exception, here. The errors are `LoopHandle.call`'s."""
    future: concurrent.futures.Future[R] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return  # the caller gave up waiting: do nothing late
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  (handed to the calling thread)
            future.set_exception(exc)

    try:
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon_threadsafe(_as_asyncio, run)
        else:
            loop.run_sync_soon(run)
    except RuntimeError as exc:  # asyncio's "Event loop is closed", trio's RunFinishedError
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
