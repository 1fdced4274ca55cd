"""The run's task tree and where each task waits, for the stall watchdog's report.

Under trio: every task from `trio.lowlevel.current_root_task()` down through its nurseries;
under asyncio (and behind the trio-asyncio bridge): `asyncio.all_tasks(loop)`. Each task is
given with the innermost frame of its await chain that is not the event loop's own machinery
(trio, anyio, asyncio, trio-asyncio, outcome): the line that waits. A loop blocked by
synchronous code cannot walk its own tasks; `thread_stack` reads the loop thread's stack
from another thread instead (`sys._current_frames()`).

Read only, and only when a report is made: nothing here runs while the run moves.
"""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

import sniffio

from .report import TaskFrame

#: At most this many tasks in a report (a run has a task per rollout worker, and more).
MAX_TASKS = 200

_LOOP_PACKAGES = ("trio", "anyio", "asyncio", "trio_asyncio", "outcome", "sniffio")
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])


def _is_loop_machinery(filename: str) -> bool:
    parts = os.path.normcase(filename).replace("\\", "/").split("/")
    return any(package in parts for package in _LOOP_PACKAGES)


def _where(frame: FrameType | None, lineno: int | None = None) -> str:
    if frame is None:
        return ""
    code = frame.f_code
    return f"{code.co_filename}:{lineno or frame.f_lineno} in {code.co_name}"


def _await_chain(coro: Any) -> Iterator[FrameType]:
    """The frames of a coroutine's await chain, outermost first."""
    seen = 0
    while coro is not None and seen < 256:
        seen += 1
        frame = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "gi_frame", None)
            or getattr(coro, "ag_frame", None)
        )
        if frame is not None:
            yield frame
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )


_OWN = os.path.normcase(os.path.dirname(os.path.abspath(__file__)))


def waiting_line(coro: Any) -> tuple[str, str]:
    """Where `coro` waits: the innermost frame of its await chain outside the loop's
    machinery (else the innermost at all), and the outermost outside art_trio too (the
    user's code that made the call; "" if none or the same)."""
    last: FrameType | None = None
    outside: FrameType | None = None
    entry: FrameType | None = None
    for frame in _await_chain(coro):
        last = frame
        filename = frame.f_code.co_filename
        if _is_loop_machinery(filename):
            continue
        outside = frame
        if entry is None and not os.path.normcase(filename).startswith(_OWN):
            entry = frame
    where = _where(outside or last)
    awaited_from = _where(entry)
    return where, "" if awaited_from == where else awaited_from


def trio_tasks() -> list[TaskFrame]:
    """Every trio task from the root down, each with the line it waits on (under trio)."""
    import trio

    found: list[TaskFrame] = []

    def visit(task: trio.lowlevel.Task, depth: int) -> None:
        if len(found) >= MAX_TASKS:
            return
        found.append(TaskFrame("trio", task.name, depth, *waiting_line(task.coro)))
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                visit(child, depth + 1)

    visit(trio.lowlevel.current_root_task(), 0)  # type: ignore[arg-type]
    return found


def asyncio_tasks(loop: asyncio.AbstractEventLoop | None) -> list[TaskFrame]:
    """The asyncio tasks of `loop` (None: the running one), each with the line it waits on."""
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return []
    found: list[TaskFrame] = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        if len(found) >= MAX_TASKS:
            break
        where = waiting_line(task.get_coro())
        found.append(TaskFrame("asyncio", task.get_name(), 0, *where))
    return found


def task_tree(asyncio_loop: asyncio.AbstractEventLoop | None) -> tuple[TaskFrame, ...]:
    """The run's tasks: trio's tree (under trio) then the asyncio tasks of `asyncio_loop`
    (the bridge's trio-asyncio loop under trio; under asyncio, None: the running loop)."""
    tasks: list[TaskFrame] = []
    if sniffio.current_async_library() == "trio":
        tasks.extend(trio_tasks())
        if asyncio_loop is not None:
            tasks.extend(asyncio_tasks(asyncio_loop))
    else:
        tasks.extend(asyncio_tasks(None))
    return tuple(tasks)


def thread_stack(thread_id: int, limit: int = 12) -> tuple[tuple[str, ...], str]:
    """Another thread's stack (innermost last, at most `limit` frames) and its innermost
    frame outside the standard library: where synchronous code blocks that thread."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return (), ""
    summary = traceback.extract_stack(frame)
    lines = tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in summary[-limit:])
    blocking = ""
    for f in reversed(summary):
        if not os.path.normcase(f.filename).startswith(_STDLIB) or "site-packages" in f.filename:
            blocking = f"{f.filename}:{f.lineno} in {f.name}"
            break
    return lines, blocking or (lines[-1] if lines else "")
