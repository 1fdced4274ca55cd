"""One `train()` call: its loop, its progress keeper, its start-up, its run and its end.

A `TrainSession` lives from the first line of `PipelineTrainer.train()` to its last; the trainer
keeps only what outlives a call (its configuration, its observers, the last run's view).
While a call lives, the trainer hands calls from other threads to its loop.

Start-up (`open_run`) asks the backend for its step, opens the progress keeper there (a
durable store settles a batch left pending by a run that died inside `backend.train`), builds
the run, queues the evals a stop interrupted (and the start-of-run eval), and writes the
progress once. Nothing is written before the run is built, so a stop during start-up (a
cancellation of it) leaves the state on disk as it was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from ..config.settings import PipelineSettings
from ..messages.events import RunStatistics
from ..observation.fates import RunCounters
from ..plumbing.bridge.calls import Bridge
from ..plumbing.progress import ProgressKeeper, RunProgress
from ..plumbing.threads import LoopHandle
from ..run import PipelineRun, RunConfiguration, compose_statistics
from ..stages import StageExtension
from ..stages.control import stop_start_up_on_signal
from .compose import admission_policy, progress_keeper, run_extensions
from .supervision import (
    bridged,
    close_run,
    lone_error_raised,
    long_lived_objects_frozen,
    raise_observer_error,
    run_stages,
)

logger = logging.getLogger("art_trio")


class Trainer(RunConfiguration, Protocol):
    """What a `train()` call reads of its `PipelineTrainer` (its configuration as the call
    starts) and what it tells it (`last_counters`)."""

    autotune: Any
    extensions: tuple[StageExtension, ...]
    progress_keeper: Callable[[Any], ProgressKeeper] | None
    last_counters: RunCounters | None

    @property
    def statistics(self) -> Callable[[], RunStatistics]: ...

    @property
    def resize(self) -> Callable[..., RunStatistics]: ...


def escalated(stop: str | None, *, force: bool) -> str:
    """A stop requested again: "force" once either request forces, else "graceful"."""
    return "force" if force or stop == "force" else "graceful"


class TrainSession:
    """One `train()` call of `trainer`; `stop` is a stop requested before it began."""

    def __init__(self, trainer: Trainer, *, handle_signals: bool, stop: str | None) -> None:
        self.trainer = trainer
        self.handle_signals = handle_signals
        #: The call's event loop: calls from other threads are handed to it (start-up too:
        #: the start-up's cancel scope and the settings belong to this thread).
        self.loop = LoopHandle()
        #: A stop requested before the run was built: None, "graceful" or "force".
        self.stop_before_start = stop
        #: Where the call keeps its progress (acquired for the whole call).
        self.keeper: ProgressKeeper | None = None
        #: Cancelled by a stop during start-up (set while the run is being built).
        self.prepare_scope: anyio.CancelScope | None = None
        #: The reason of the last resize made before the run was built (its Resized event's).
        self.startup_resize_reason = "resize"
        #: The run, from when it is built until it has finished.
        self.run: PipelineRun | None = None
        #: The run's extensions, told of the user's own resizes.
        self.extensions: list[StageExtension] = []
        #: The finished run's last view (None until it has finished).
        self.last_statistics: RunStatistics | None = None
        #: The signal that stopped the call (SIGINT during start-up, or the run's).
        self.signal: int | None = None

    def view(self) -> RunStatistics | None:
        """The run's statistics: live while it runs, its last view once it has finished;
        None before it is built (or if it never was)."""
        return self.run.statistics(running=True) if self.run else self.last_statistics

    @property
    def stop_signal(self) -> int | None:
        return self.run.stop.signal if self.run is not None else self.signal

    def resized(self, settings: PipelineSettings, reason: str, sizes: dict[str, Any]) -> None:
        """The user resized the run to `settings` (`sizes`: the values they gave)."""
        if self.run is None:
            # Before the run is built: it starts with them (see `_open`).
            self.startup_resize_reason = reason
            return
        self.run.resize(settings, reason)
        for extension in self.extensions:
            # The user's values win over an autotuner's (it stops changing what they set).
            told = getattr(extension, "resized", None)
            if told is not None:
                told(**{k: v for k, v in sizes.items() if k != "queue_maxsize"})

    def request_stop(self, *, force: bool) -> None:
        """Stop the run; before it is built, stop its start-up (or, with no start-up
        running, the run as soon as it is built)."""
        if self.run is not None:
            if force:
                self.run.stop.cancel_everything()
            else:
                self.run.stop.request()
            return
        self.stop_before_start = escalated(self.stop_before_start, force=force)
        if self.prepare_scope is not None:
            self.prepare_scope.cancel()

    async def train(self, task_status: TaskStatus[None]) -> None:
        t = self.trainer
        keeper = (
            t.progress_keeper(t.model) if t.progress_keeper is not None
            else progress_keeper(t.settings, t.model)
        )
        keeper.acquire()
        self.keeper = keeper
        try:
            with long_lived_objects_frozen():
                async with bridged() as bridge:
                    await self._train_in(bridge, task_status)
        finally:
            keeper.release()

    async def _train_in(self, bridge: Bridge, task_status: TaskStatus[None]) -> None:
        t = self.trainer
        run = await self._open(bridge)
        if run is None:
            # Stopped during start-up: nothing ran and nothing was written; what it shows
            # (counters and statistics alike) is a run that saw no event, not the last one.
            t.last_counters = RunCounters()
            self.last_statistics = compose_statistics(running=False, settings=t.settings)
            task_status.started()
            return
        try:
            self.extensions = run_extensions(
                t.settings, t.autotune, t.rollout_executor, t.extensions
            )
            await run_stages(
                run, self.extensions, statistics=t.statistics, resize=t.resize,
                handle_signals=self.handle_signals, task_status=task_status,
            )
        except BaseException as exc:
            self._finish(run, exc)
            raise
        self._finish(run, None)
        raise_observer_error(run)  # one that raised while the final state was saved

    async def _open(self, bridge: Bridge) -> PipelineRun | None:
        """The run, built; None if a stop came during start-up (then nothing was written).
        A resize or a stop made while it was built applies to it from the start."""
        run = None
        # What the run is built from: a resize during start-up changes the settings.
        configured = self.trainer.settings
        assert self.keeper is not None  # acquired by train() before this runs
        with anyio.CancelScope() as prepare_scope:
            self.prepare_scope = prepare_scope

            def stopped_by(signum: int) -> None:
                self.signal = signum
                prepare_scope.cancel()

            try:
                with lone_error_raised():
                    async with anyio.create_task_group() as signals:
                        # The signals are the trainer's from here: a first SIGINT or SIGTERM
                        # during start-up is a stop, and nothing has started yet.
                        main = threading.current_thread() is threading.main_thread()
                        hearing = self.handle_signals and main
                        if hearing:
                            await signals.start(stop_start_up_on_signal, stopped_by)
                        run = await open_run(bridge, self.trainer, self.keeper)
                        # A signal that came while code that does not yield opened the run is
                        # heard before the handlers are given up (then it stops the run below).
                        # Under asyncio it takes three passes of the loop: the self-pipe read,
                        # the handler's callback, the receiver's wake-up; trio needs one.
                        for _ in range(4 if hearing else 0):
                            await anyio.lowlevel.checkpoint()
                        signals.cancel_scope.cancel()
            finally:
                self.prepare_scope = None
        if run is None:
            return None
        self.run = run
        if self.signal is not None:
            run.stop.signal = self.signal
            run.stop.request()
        if self.trainer.settings is not configured:
            run.resize(self.trainer.settings, self.startup_resize_reason)
        if self.stop_before_start is not None:
            self.request_stop(force=self.stop_before_start == "force")
        return run

    def _finish(self, run: PipelineRun, failure: BaseException | None) -> None:
        """Keep the run's last view and counters, then save its state (`close_run`)."""
        # The last view first: a thread reading statistics() never finds neither.
        self.last_statistics = run.statistics(running=False)
        self.signal = run.stop.signal
        self.run = None
        self.extensions = []
        self.trainer.last_counters = run.counters
        close_run(run, failure)


async def open_run(bridge: Bridge, trainer: Trainer, keeper: ProgressKeeper) -> PipelineRun:
    """The run of `trainer`, with the evals it starts with already queued."""
    settings = trainer.settings
    start_step = int(await bridge.call(trainer.model.get_step))
    state, resumed = keeper.open(start_step, resume=settings.persistence.resume)
    run = PipelineRun(
        trainer, bridge=bridge, keeper=keeper, state=state, start_step=start_step,
        admission=admission_policy(settings),
    )
    # The resolved prefix is skipped by the rollout stage's first take, where a stop
    # reaches it (a slow source can take long to skip).
    if trainer.eval_fn is not None:
        _queue_first_evals(
            state, run.eval_send, start_step,
            at_start=settings.evaluation.eval_at_start and (not resumed or start_step == 0),
        )
    run.snapshot()
    return run


def _queue_first_evals(
    state: RunProgress, eval_send: MemoryObjectSendStream[int], start_step: int,
    *, at_start: bool,
) -> None:
    """Evals a stop interrupted, then the start-of-run eval."""
    for step in sorted(state.pending_eval_steps - state.completed_eval_steps):
        if step <= start_step:
            eval_send.send_nowait(step)
    # The start step of a fresh run (or a run at step 0), once: a resumed run re-ran its
    # interrupted evals above and keeps its every-n schedule (ART 0.5.18 instead evaluates
    # whatever step it resumes at, and restarts the schedule from there).
    if at_start and start_step not in state.pending_eval_steps | state.completed_eval_steps:
        state.schedule_eval(start_step)
        eval_send.send_nowait(start_step)
