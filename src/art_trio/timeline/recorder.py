"""Recording a run's events to a timeline log, through the public observer API only.

    from art_trio.timeline import record_timeline

    with record_timeline(trainer, "run.jsonl"):
        await trainer.train()

The recorder is an observer (`trainer.add_observer`): it reads the clock when it hears an
event and appends a line; it never calls into the run. The `with` block frames the run: its
start writes `RunStarted` (the policy version and sizes the run starts from), its end writes
`RunEnded` with how the block ended (returned, raised, cancelled) and closes the file, whatever
`train()` did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from .log import LogWriter, encode_event

if TYPE_CHECKING:
    from art_trio import PipelineTrainer, RunEvent


def loop_clock() -> Callable[[], float]:
    """The running event loop's clock (virtual under trio's MockClock), or the monotonic
    clock outside one."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return time.monotonic
    if library == "trio":
        import trio

        return trio.current_time
    if library == "asyncio":
        import asyncio

        return asyncio.get_running_loop().time
    return anyio.current_time


def how_it_ended(exc: BaseException | None) -> tuple[str, str | None]:
    """`returned`, `cancelled` or `raised` (with the error's type and message). A group of
    cancellations alone (a nursery's, as trio raises them) is a cancellation."""
    if exc is None:
        return "returned", None
    try:
        cancelled: type[BaseException] | None = anyio.get_cancelled_exc_class()
    except sniffio.AsyncLibraryNotFoundError:
        cancelled = None

    def is_cancelled(e: BaseException) -> bool:
        if isinstance(e, BaseExceptionGroup):
            return all(is_cancelled(inner) for inner in e.exceptions)
        return (cancelled is not None and isinstance(e, cancelled)) or type(e).__name__ in {
            "Cancelled",
            "CancelledError",
        }

    if is_cancelled(exc):
        return "cancelled", None
    return "raised", f"{type(exc).__name__}: {exc}"


class TimelineRecorder:
    """An observer writing each event it hears as one line of a timeline log."""

    def __init__(self, writer: LogWriter, clock: Callable[[], float]) -> None:
        self.writer = writer
        self.clock = clock

    def __call__(self, event: RunEvent) -> None:
        self.writer.write_encoded(self.clock(), encode_event(event))

    def mark(self, name: str, **fields: Any) -> None:
        """A line that is not a run event (`RunStarted`, `RunEnded`), at the clock's now."""
        self.writer.write(self.clock(), name, **fields)


def run_started_fields(trainer: PipelineTrainer[Any, Any]) -> dict[str, Any]:
    """What a run starts from, read from the trainer's public statistics and settings."""
    stats = trainer.statistics()
    settings = trainer.settings
    return {
        "policy_version": stats.policy_version,
        "num_rollout_workers": stats.num_rollout_workers,
        "min_batch_size": stats.min_batch_size,
        "max_batch_size": stats.max_batch_size,
        "max_steps_off_policy": settings.freshness.max_steps_off_policy,
    }


@contextmanager
def record_timeline(
    trainer: PipelineTrainer[Any, Any],
    path: str | Path,
    *,
    clock: Callable[[], float] | None = None,
) -> Iterator[TimelineRecorder]:
    """Record the events of the runs inside the block to `path` (overwritten).

    `clock` defaults to the event loop's (enter the block inside the loop, as around
    `await trainer.train()`). The observer is removed and the file closed on every way out.
    """
    recorder = TimelineRecorder(LogWriter(path), clock or loop_clock())
    try:
        recorder.mark("RunStarted", **run_started_fields(trainer))
        remove = trainer.add_observer(recorder)
    except BaseException:
        recorder.writer.close()
        raise
    outcome, error = "returned", None
    try:
        yield recorder
    except BaseException as exc:
        outcome, error = how_it_ended(exc)
        raise
    finally:
        remove()
        recorder.mark("RunEnded", outcome=outcome, error=error)
        recorder.writer.close()
