"""The control stage: turns stop requests and signals into cancellation, on time.

- First stop (`request_stop()`, SIGINT or SIGTERM): no new rollout or eval starts; those in
  flight get `shutdown_grace_seconds` to finish, then their cancel scopes are cancelled. The
  training stage lets a running `backend.train` finish and starts no new one.
- Second SIGINT/SIGTERM: every stage is cancelled at once, and the host's handlers are put
  back right away: code that ignores cancellation (a rollout that catches it and goes on)
  can keep `train()` from returning, and a third signal then does what it does without the
  trainer (SIGTERM's default action ends the process; under trio SIGINT raises
  KeyboardInterrupt in the main task, which waits for that code like any cancellation).
Signal handlers are installed only from the main thread and restored afterwards.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import anyio
from anyio.abc import TaskStatus

from ..plumbing.stop import StopControl

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
logger = logging.getLogger("art_trio")


class ControlStage:
    """Turns stop requests and signals into cancellation (see the module's docstring)."""

    name = "control"

    def __init__(self, stop: StopControl, *, handle_signals: bool) -> None:
        self.stop = stop
        self.handle_signals = handle_signals

    async def __call__(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reports started once the signals are taken over (the trainer starts the other
        stages only then: a Ctrl-C as the first status line appears must be a stop, not a
        traceback)."""
        stop = self.stop
        async with anyio.create_task_group() as tg:
            tg.start_soon(_enforce_grace, stop)
            if self.handle_signals:
                if threading.current_thread() is threading.main_thread():
                    await tg.start(_receive_signals, stop)
                else:
                    warnings.warn(
                        "handle_signals=True is ignored: signal handlers can only be installed "
                        "from the main thread. Call trainer.request_stop() to stop this run.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            task_status.started()
            await stop.finished.wait()
            tg.cancel_scope.cancel()


async def _enforce_grace(stop: StopControl) -> None:
    await stop.requested.wait()
    with anyio.move_on_after(stop.grace_seconds):
        await stop.rollouts_done.wait()
        await stop.eval_idle.wait()
    stop.rollout_scope.cancel()
    if stop.eval_scope is not None:
        stop.eval_scope.cancel()


@contextmanager
def _stop_signals() -> Iterator[AsyncIterator[int]]:
    """SIGINT and SIGTERM as they arrive, taken over from the host and given back on leaving
    (exactly the host's handlers, not the loop's defaults). Not one the process ignores: a
    background job started with SIGINT ignored stays deaf to it (with both ignored, nothing
    arrives; trio refuses a receiver of no signal)."""
    previous = {
        sig: handler for sig in STOP_SIGNALS
        if (handler := signal.getsignal(sig)) is not signal.SIG_IGN
    }
    if not previous:
        yield _nothing()
        return
    try:
        with anyio.open_signal_receiver(*previous) as received:
            yield received
    finally:
        for sig, handler in previous.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


async def _nothing() -> AsyncIterator[int]:
    return
    yield


async def stop_start_up_on_signal(
    stop: Callable[[int], None], *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """During start-up (before the control stage runs): the first SIGINT or SIGTERM calls
    `stop(signum)` (which cancels the start-up), and the host's handlers are put back."""
    with _stop_signals() as received:
        task_status.started()
        async for signum in received:
            logger.warning(
                "Shutdown requested (%s) during start-up: nothing was started.",
                signal.Signals(signum).name,
            )
            stop(signum)
            return


async def _receive_signals(
    stop: StopControl, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with _stop_signals() as received:
        task_status.started()
        async for signum in received:
            name = signal.Signals(signum).name
            if not stop.stopping:
                grace = stop.grace_seconds
                within = "as long as it takes" if math.isinf(grace) else f"up to {grace:g}s"
                logger.warning(
                    "Shutdown requested (%s): finishing in-flight work (%s); send %s "
                    "again to stop at once.", name, within, name,
                )
                stop.signal = signum
                stop.request()
            else:
                logger.warning(
                    "Second %s: cancelling everything now (a third %s gets the program's "
                    "own handler).", name, name,
                )
                stop.cancel_everything()
                return  # leaving restores the host's handlers (see the docstring)
