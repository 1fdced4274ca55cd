"""Recording a run's events to a timeline log, through the public observer API only.

    from art_trio.timeline import record_timeline

    with record_timeline(trainer, "run.jsonl"):
        await trainer.train()

The recorder is an observer (`trainer.add_observer`): it reads the clock when it hears an
event and appends a line; it never calls into the run. The `with` block frames the run:
`RunStarted` is timed at its start and written with the first event (so it holds the policy
version the run starts from, which the backend tells the run as it starts, and the sizes in
force), its end writes `RunEnded` with how the block ended (returned, raised with the error
`train()` raised inside its group, cancelled) and closes the file, whatever `train()` did.

A log is a diagnosis, never a reason to stop training: a write that fails (a full disk) is
warned about once, and the recorder stops recording.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from .log import LogWriter, encode_event, encode_fields

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
    """`returned`, `cancelled` or `raised` with what was raised ("Type: message"). `train()`
    raises a stage's error inside a group, so the errors in the group are what is said; a
    group of cancellations alone (a nursery's, as trio raises them) is a cancellation."""
    if exc is None:
        return "returned", None
    errors = run_errors(exc)
    if not errors:
        return "cancelled", None
    return "raised", "; ".join(f"{type(e).__name__}: {e}" for e in errors)


def run_errors(exc: BaseException) -> list[BaseException]:
    """The errors `exc` holds (itself, or a group's, however nested), cancellations left out."""
    if isinstance(exc, BaseExceptionGroup):
        return [e for inner in exc.exceptions for e in run_errors(inner)]
    try:
        cancelled: type[BaseException] | None = anyio.get_cancelled_exc_class()
    except RuntimeError:  # outside an event loop (sniffio's or anyio's NoEventLoopError)
        cancelled = None
    if (cancelled is not None and isinstance(exc, cancelled)) or type(exc).__name__ in {
        "Cancelled",
        "CancelledError",
    }:
        return []
    return [exc]


#: Events after which the log reaches the file at once: each is rare, and a run killed
#: after one can be drawn up to it.
_MILESTONES = frozenset(
    {"StepTrained", "PolicyPublished", "TrainCallStarted", "EvalStarted", "EvalEnded",
     "Stalled", "Resized", "Collapsed", "ChannelClosed"}
)


class TimelineRecorder:
    """An observer writing each event it hears as one line of a timeline log."""

    def __init__(
        self,
        writer: LogWriter,
        clock: Callable[[], float],
        started: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.writer = writer
        self.clock = clock
        #: `RunStarted`'s time and what reads its fields, until it is written.
        self._start: tuple[float, Callable[[], dict[str, Any]]] | None = (
            None if started is None else (clock(), started)
        )
        self._flush_after: dict[type, bool] = {}
        #: The write that failed (then nothing more is written).
        self.failed: OSError | None = None

    def __call__(self, event: RunEvent) -> None:
        kind = type(event)
        flush = self._flush_after.get(kind)
        if flush is None:
            flush = self._flush_after[kind] = kind.__name__ in _MILESTONES
        self._line(encode_event(event), flush)

    def mark(self, name: str, **fields: Any) -> None:
        """A line that is not a run event (`RunStarted`, `RunEnded`), at the clock's now."""
        self._line(encode_fields(name, fields), True)

    def _line(self, body: str, flush: bool) -> None:
        """One line at the clock's now, after `RunStarted` if that is still to be written;
        a write that fails ends the recording (`_fail`)."""
        if self.failed is not None:
            return
        try:
            if self._start is not None:
                (t, fields), self._start = self._start, None
                self.writer.write(t, "RunStarted", flush=True, **fields())
            self.writer.write_encoded(self.clock(), body, flush=flush)
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        """Close the file (what is buffered is written; a failure to is warned about)."""
        try:
            self.writer.close()
        except OSError as exc:
            if self.failed is None:
                self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.failed = exc
        warnings.warn(
            f"the timeline log {self.writer.path} could not be written ({exc}); recording "
            "stopped there, training goes on",
            RuntimeWarning,
            stacklevel=4,  # where the event was emitted (through __call__ and _line)
        )


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
    writer = LogWriter(path)
    try:
        recorder = TimelineRecorder(
            writer, clock or loop_clock(), started=lambda: run_started_fields(trainer)
        )
        remove = trainer.add_observer(recorder)
    except BaseException:
        writer.close()
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
        recorder.close()
