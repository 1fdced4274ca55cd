"""PipelineTrainer: rollouts, training and eval overlapped under a staleness bound.

One `train()` opens one task group with the run's stages (rollout, training, eval, status,
control) and its extensions' (the stall watchdog, the autotuner, the user's). They talk over
memory channels with capacity limits and share one policy gate; a stop or a failure travels
as cancellation, so when `train()` returns nothing it started is still running.

This module is the public facade only: one `train()` call is in session.py, supervision in
supervision.py, the extensions a run's settings ask for in compose.py, ART's keywords in
config/keywords.py, the work in stages/ (each stage is given the run, `run.py`).
"""

from __future__ import annotations

import functools
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Generic

import anyio
import art
from anyio.abc import TaskStatus

from ..config import keywords
from ..config.backend_support import check_backend_support
from ..config.settings import FIELDS, PipelineSettings
from ..messages.errors import LoopUnresponsive, _LoopClosed
from ..messages.events import Observer, Observers, RunStatistics
from ..messages.types import ConfigT, EvalFn, RolloutFn, ScenarioT
from ..observation.fates import RunCounters
from ..plumbing.compat import PipelineAutotuneConfig, PipelineRuntimeConfig
from ..plumbing.executor import RolloutExecutor
from ..plumbing.progress import ProgressKeeper
from ..plumbing.source import ScenarioCursor
from ..plumbing.threads import DEFAULT_TIMEOUT_S
from ..run import compose_statistics
from ..stages import StageExtension
from .compose import tuned_start
from .session import TrainSession, escalated


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """ART's `PipelineTrainer` on structured concurrency; runs under trio and asyncio.

    Takes every parameter of the installed ART's trainer (0.5.17-0.5.18 or 0.5.20+) with the
    same name and default, and raises ART's ValueError text for the same bad value. Both
    lines' spellings work on either: the runtime settings as keyword arguments (on 0.5.20+
    with ART's DeprecationWarning, and ART's defaults) or as
    `pipeline=PipelineRuntimeConfig(...)`; ART 0.5.20's `limit_mean_steps_off_policy`,
    `rollout_executor` (ART's `RolloutExecutor` protocol; a worker that dies raises
    `RolloutLost` and its scenario is rolled again) and training kwargs. art_trio's own
    settings (`shutdown_grace_seconds`, `admission`, `max_rollouts_beyond_bound`,
    `fsync_state`, `max_consecutive_rollout_failures`) and ART's are documented where they
    are declared, in their groups (art_trio.config.settings: `Sizes`, `Shutdown`, ...).

    `rollout_fn`, `eval_fn` and async scenario iterators are asyncio code unless marked with
    `art_trio.trio_native`. A group of settings may also be passed whole (`sizes=Sizes(...)`).
    Read them back as `trainer.settings.sizes.max_batch_size` (typed) or, as on ART's
    trainer, as attributes (`trainer.max_batch_size`).
    """

    settings: PipelineSettings

    def __init__(
        self,
        model: art.TrainableModel,
        backend: Any,
        rollout_fn: RolloutFn,
        scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT],
        config: ConfigT,
        eval_fn: EvalFn | None = None,
        *,
        pipeline: PipelineRuntimeConfig | None = None,
        autotune: PipelineAutotuneConfig | None = None,
        rollout_executor: RolloutExecutor | None = None,
        score_reference_groups_per_step: float | None = None,
        score_reference_rollouts_per_group: float | None = None,
        eval_step_0: bool = True,
        extensions: Sequence[StageExtension] = (),
        progress_keeper: Callable[[art.TrainableModel], ProgressKeeper] | None = None,
        **settings: Any,
    ) -> None:
        #: The `autotune=` config (None or mode "off": the sizes stay as set).
        self.autotune = autotune
        self.settings = keywords.resolve_settings(
            settings, pipeline=pipeline, autotune=autotune,
            rollout_executor=rollout_executor, eval_step_0=eval_step_0,
            tuned_start=tuned_start(autotune, model),
        )
        keywords.check_arguments(
            model, backend, rollout_fn, eval_fn, scenarios, rollout_executor, extensions,
            progress_keeper,
        )
        #: Your own extensions, run beside the stages of every run (see `StageExtension`).
        self.extensions = tuple(extensions)
        #: Makes each run's `ProgressKeeper` (None: the durable store, or ART's own record
        #: with `resume=False`).
        self.progress_keeper = progress_keeper
        self.model = model
        self.backend = backend
        self.rollout_fn = rollout_fn
        #: Where rollouts run (None: in this process, with no executor in between).
        self.rollout_executor = rollout_executor
        self.config = config
        self.eval_fn = eval_fn
        self._scenarios = ScenarioCursor(scenarios)
        #: ART 0.5.20's objective-score references, kept as given (see compat.py).
        self.score_reference_groups_per_step = score_reference_groups_per_step
        self.score_reference_rollouts_per_group = score_reference_rollouts_per_group
        self._score_references = keywords.score_references(
            pipeline, score_reference_groups_per_step, score_reference_rollouts_per_group
        )
        #: The running `train()` call, from its first line to its last (None between calls).
        self._session: TrainSession | None = None
        #: A stop requested before `train()` began: None, "graceful" or "force".
        self._stop_before_start: str | None = None
        #: The most recent run's tally (taken, trained, stale, ...), kept after train() returns.
        self.last_counters: RunCounters | None = None
        self._observers = Observers()
        #: The last finished run's view, and the signal that stopped the last call.
        self._last_statistics: RunStatistics | None = None
        self._stop_signal: int | None = None
        self._validate_backend_support()

    def __getattr__(self, name: str) -> Any:
        # ART's trainer keeps its settings as attributes (`trainer.max_batch_size`).
        settings = self.__dict__.get("settings")
        if settings is not None and name in FIELDS:
            return settings.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    async def train(
        self,
        *,
        handle_signals: bool = True,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the pipeline until `max_steps`, the end of the scenarios, a stop, or a failure.

        Works under `trio.run`, `anyio.run` (either backend) and `await nursery.start(...)`
        (reports started once every stage is running). A stage's exception cancels the other
        stages and reaches the caller (inside an ExceptionGroup, as task groups raise), with
        a note naming the stage; a KeyboardInterrupt or SystemExit raised by a callback ends
        the run the same way and is re-raised as itself. The resume state is persisted on
        every way out; if that fails after a failure, the failure is raised with a note.

        One run per model directory (with `resume=True`, the default): a second `train()` on
        the same directory, from this trainer, another trainer or another process, raises
        `RunLockedError` at once and trains nothing. A `resume=False` run takes no lock, as
        ART's trainer: point it at a directory no other run is using.
        """
        if self._session is not None:
            raise RuntimeError(
                "train() is already running on this trainer; await it (or stop it with "
                "request_stop()) before calling train() again"
            )
        # Set before the first await, so that a second call in the same tick is refused too.
        self._session = session = TrainSession(
            self, handle_signals=handle_signals, stop=self._stop_before_start
        )
        self._stop_before_start = None
        try:
            await session.train(task_status)
        finally:
            self._session = None
            self._stop_signal = session.stop_signal
            self._last_statistics = session.last_statistics or self._last_statistics

    def statistics(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> RunStatistics:
        """The run as it is now: an immutable snapshot, cheap enough to take every step.

        During `train()` it is live; afterwards it is the finished run's last view; before
        the first `train()` it shows the configured sizes and zero counts.

        Callable from any thread (a metrics exporter, a watchdog): from another thread than
        the run's event loop, the snapshot is taken on the loop, between two tasks' steps,
        so it is one consistent instant; the caller waits for it for up to `timeout`
        seconds, then gets `art_trio.LoopUnresponsive` (something is blocking the loop).
        """
        session = self._session
        if session is not None and not session.loop.in_loop_thread():
            try:
                return session.loop.call(
                    self.statistics, timeout=timeout, what="trainer.statistics()"
                )
            except _LoopClosed:
                pass  # the run ended meanwhile: its last view follows
            except LoopUnresponsive:
                if self._session is session:
                    raise
                # The run ended while the call waited (a loop that closes drops what was
                # scheduled on it): its last view follows.
        session = self._session
        view = session.view() if session is not None else self._last_statistics
        if view is not None:
            return view
        # Before the first run (or while one starts): the configured sizes, and the counters
        # of a run that has seen no event.
        return compose_statistics(running=False, settings=self.settings)

    def add_observer(self, observer: Observer) -> Callable[[], None]:
        """Call `observer(event)` for each event of every run from now on (see events.py:
        every class in `RunEvent`, from `RolloutStarted` to `ScenarioSettled`, `StepTrained`
        and `Resized`). The run's own counters and status line fold the same events first.
        Returns a function that removes it.

        The observer runs in the trainer's own task, synchronously, the moment the event
        happens: it must return quickly and never block; an exception it raises ends the run
        as a failure of the stage it was called from. Once the run is failing, an observer
        raising while the run winds down is logged and noted on the first error, which is
        the one `train()` raises.
        """
        return self._observers.add(observer)

    def resize(
        self,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        queue_maxsize: int | None = None,
        reason: str = "resize",
    ) -> RunStatistics:
        """Change the run's sizes while `train()` runs; the new values hold from now on.

        New rollout workers start at once in the rollout stage's task group; extra ones
        leave after the rollout they hold (one waiting at the gate leaves at once), so no
        scenario is lost or trained twice. Batch sizes apply from the next batch collected.
        A larger `queue_maxsize` lets blocked rollout workers hand over as the trainer takes
        groups; a smaller one leaves what is queued in place. Values given are checked as
        the constructor checks them (ValueError). `trainer.settings` is the one settings
        object: the running run's, and the next run starts with it (a resize before
        `train()` or during its start-up included). Returns the statistics after the
        change. From another thread than the run's event loop, the change is made on the
        loop (waiting up to 10 s for it, else `art_trio.LoopUnresponsive` and nothing
        changed).
        """
        sizes = dict(
            num_rollout_workers=num_rollout_workers, min_batch_size=min_batch_size,
            max_batch_size=max_batch_size, queue_maxsize=queue_maxsize,
        )
        session = self._session
        if session is not None and not session.loop.in_loop_thread():
            try:
                return session.loop.call(
                    functools.partial(self.resize, **sizes, reason=reason),
                    timeout=DEFAULT_TIMEOUT_S, what="trainer.resize()",
                )
            except _LoopClosed:
                session = None  # the run ended meanwhile: the next one starts with the change
        # The one settings object: the run's while one goes (the next run starts with them).
        self.settings = keywords.resize_settings(
            self.settings, self.rollout_executor, running=bool(session and session.run), **sizes
        )
        if session is not None:
            session.resized(self.settings, reason, sizes)
        return self.statistics()

    @property
    def stop_signal(self) -> signal.Signals | None:
        """The signal (SIGINT or SIGTERM) that stopped the last `train()`, None if none did.

        `train()` returns normally after a signal's clean stop; a program that should end as
        an interrupted one does (exit status 130 for SIGINT) checks this:
        `if trainer.stop_signal: sys.exit(128 + trainer.stop_signal)`.
        """
        number = self._session.stop_signal if self._session is not None else self._stop_signal
        return None if number is None else signal.Signals(number)

    def request_stop(self, *, force: bool = False) -> None:
        """Stop cleanly: take no more scenarios, finish or cancel in-flight work, return.

        `force=True` is what a second SIGINT/SIGTERM does: cancel everything now, a running
        `backend.train` and eval included (the batch in flight is then settled against the
        backend's step on resume); the state is still saved and `train()` returns normally.
        Call `request_stop()` first and `request_stop(force=True)` later to escalate.

        Call it from anywhere: from another thread than the run's event loop it is handed
        to the loop (and returns once the loop took it, or after 10 s with
        `art_trio.LoopUnresponsive`). During start-up it ends `train()` before anything
        runs; before `train()` starts, it makes the next `train()` stop at once.
        """
        session = self._session
        if session is None:
            # Honoured when the next run is built.
            self._stop_before_start = escalated(self._stop_before_start, force=force)
        elif not session.loop.in_loop_thread():
            try:
                session.loop.call(
                    functools.partial(self.request_stop, force=force),
                    timeout=DEFAULT_TIMEOUT_S, what="trainer.request_stop()",
                )
            except _LoopClosed:
                pass  # the run has ended: nothing left to stop
        else:
            session.request_stop(force=force)

    def _validate_backend_support(self) -> None:
        # A method, as ART's trainer has it (tests stub it to run a LocalBackend double).
        check_backend_support(self.backend, self.model, self.settings)


# What `inspect` (and so ART-parity tests, docs and IDEs without PEP 692) shows: every
# settings keyword spelt out with its default, from the declarations.
keywords.spell_out_settings(PipelineTrainer.__init__)
