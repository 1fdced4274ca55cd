"""PipelineTrainer: rollouts, training and eval overlapped under a staleness bound.

One `train()` opens one task group with six stages: rollout, training, eval, status,
control and the stall watchdog. They talk over memory channels with capacity limits and
share one policy gate; a stop or a failure travels as cancellation, so when `train()`
returns nothing it started is still running.

This module is the public facade only: start-up is in startup.py, supervision in
supervision.py, ART's keywords in keywords.py, the work in stages/. It is over 400 lines
because each public method carries its user-facing documentation (`resize` alone ~80 lines).
"""

from __future__ import annotations

import functools
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic

import anyio
import art
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config.backend_support import check_backend_support
from ..config.keywords import fit_executor as _fit_executor
from ..config.keywords import (
    resolve_settings,
    score_references,
    spell_out_settings,
)
from ..config.settings import FIELDS, PipelineSettings
from ..messages.errors import LoopUnresponsive, _LoopClosed
from ..messages.events import Observer, Observers, Resized, RunStatistics
from ..messages.types import ConfigT, EvalFn, RolloutFn, ScenarioT
from ..messages.values import Delivered
from ..observation.fates import CounterFold, RunCounters
from ..plumbing.bridge.calls import Bridge, is_native, open_bridge
from ..plumbing.compat import PipelineAutotuneConfig, PipelineRuntimeConfig
from ..plumbing.executor import RolloutExecutor
from ..plumbing.group_queue import GroupQueue
from ..plumbing.hooks import backend_hook
from ..plumbing.progress import ProgressKeeper
from ..plumbing.threads import DEFAULT_TIMEOUT_S, LoopHandle
from ..policy.rules import count_error
from ..run import PipelineRun, compose_statistics
from ..stages import RunView, Stage, StageExtension
from ..stages.checkpoints import CheckpointBook
from ..stages.control import ControlStage
from ..stages.evaluation import EvalStage
from ..stages.metrics import TrainMetrics
from ..stages.rollout import RolloutStage
from ..stages.status import StatusStage
from ..stages.training import TrainingStage
from .compose import admission_policy, progress_keeper, run_extensions, tuned_start
from .startup import open_run
from .supervision import BoundedStage, close_run, raise_failure, run_stage, unwrap_escaped

logger = logging.getLogger("art_trio")

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
    `art_trio.trio_native`. The settings are declared in art_trio.config.settings, in groups
    that may also be passed whole (`sizes=Sizes(...)`). Read them back as
    `trainer.settings.sizes.max_batch_size` (typed) or, as on ART's trainer, as attributes
    (`trainer.max_batch_size`).
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
        # The settings keywords, each as art_trio.config.settings declares it (`inspect` shows them
        # one by one: see keywords.trainer_signature, applied below the class).
        #: The `autotune=` config (None or mode "off": the sizes stay as set).
        self.autotune = autotune
        self.settings = resolve_settings(
            settings, model=model, pipeline=pipeline, autotune=autotune,
            rollout_executor=rollout_executor, eval_step_0=eval_step_0,
            tuned_start=tuned_start(autotune, model),
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
        self._scenarios = scenarios
        #: ART 0.5.20's objective-score references, kept as given (see compat.py).
        self.score_reference_groups_per_step = score_reference_groups_per_step
        self.score_reference_rollouts_per_group = score_reference_rollouts_per_group
        self._score_references = score_references(
            pipeline, score_reference_groups_per_step, score_reference_rollouts_per_group
        )
        self._run: PipelineRun | None = None
        #: The running run's event loop, for calls from other threads (None between runs).
        self._loop: LoopHandle | None = None
        #: A stop requested before the run existed: None, "graceful" or "force".
        self._stop_before_start: str | None = None
        self._prepare_scope: anyio.CancelScope | None = None
        #: Where the running train() keeps its progress (acquired for the whole call).
        self._keeper: ProgressKeeper | None = None
        #: True from the first line of train() to its end (the in-process guard).
        self._active = False
        #: True from the first line of train() until its run is built (start-up).
        self._starting = False
        #: The most recent run's tally (taken, trained, stale, ...), kept after train() returns.
        self.last_counters: RunCounters | None = None
        self._observers = Observers()
        self._rollouts: RolloutStage | None = None
        #: Changes the groups channel's capacity while a run goes (set with the channel).
        self._resize_queue: Callable[[int], None] | None = None
        #: The running `train()`'s extensions, told of the user's own resizes.
        self._extensions: list[StageExtension] = []
        self._last_statistics: RunStatistics | None = None
        #: The reason of the last resize made with no run built (its Resized event's).
        self._startup_resize_reason = "resize"
        self._stop_signal: int | None = None
        _check_callbacks(rollout_fn, eval_fn, scenarios)
        _check_extensions(self.extensions, progress_keeper)
        if rollout_executor is not None and is_native(rollout_fn):
            raise TypeError(
                "a trio_native rollout_fn cannot run through a rollout_executor (executors "
                "run rollouts as asyncio code, as ART's do); drop one of the two"
            )
        self._validate_backend_support()

    def __getattr__(self, name: str) -> Any:
        # ART's trainer keeps its settings as attributes (`trainer.max_batch_size`).
        settings = self.__dict__.get("settings")
        if settings is not None and name in FIELDS:
            return settings.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- public API ----------------------------------------------------------------------

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
        if self._active:
            raise RuntimeError(
                "train() is already running on this trainer; await it (or stop it with "
                "request_stop()) before calling train() again"
            )
        # Set before the first await, so that a second call in the same tick is refused too.
        self._active = True
        # From here on a call from another thread is handed to this loop, start-up included:
        # the start-up's cancel scope and the settings belong to this thread.
        self._loop = LoopHandle()
        self._starting = True
        self._stop_signal = None
        try:
            keeper = (
                self.progress_keeper(self.model) if self.progress_keeper is not None
                else progress_keeper(self.settings, self.model)
            )
            keeper.acquire()
            self._keeper = keeper
            try:
                with _long_lived_objects_frozen():
                    await self._train_locked(handle_signals, task_status)
            finally:
                self._keeper = None
                keeper.release()
        finally:
            self._loop = None
            self._starting = False
            self._active = False
            self._stop_before_start = None

    async def _train_locked(self, handle_signals: bool, task_status: TaskStatus[None]) -> None:
        failure: BaseException | None = None
        try:
            async with open_bridge() as bridge:
                try:
                    await self._train_in_bridge(bridge, handle_signals, task_status)
                except (Exception, BaseExceptionGroup) as exc:
                    # Raised below, outside the bridge: a trio-asyncio loop opened here would
                    # otherwise wrap it (the stages' group too) in groups of its own.
                    failure = exc
        except BaseExceptionGroup as group:
            unwrap_escaped(group)
        if failure is not None:
            raise_failure(failure)

    async def _train_in_bridge(
        self, bridge: Bridge, handle_signals: bool, task_status: TaskStatus[None]
    ) -> None:
        prepared = None
        # What the run is built from: a resize during start-up changes self.settings.
        configured = self.settings
        assert self._keeper is not None  # acquired by train() before this runs
        with anyio.CancelScope() as prepare_scope:
            # request_stop() during start-up cancels it: nothing has been written yet.
            self._prepare_scope = prepare_scope
            try:
                prepared = await open_run(
                    bridge, model=self.model, backend=self.backend, settings=self.settings,
                    scenarios=self._scenarios, keeper=self._keeper, rollout_fn=self.rollout_fn,
                    admission=admission_policy(self.settings),
                    eval_fn=self.eval_fn, config=self.config, executor=self.rollout_executor,
                    observers=self._observers, score_references=self._score_references,
                )
            except KeyboardInterrupt:
                # SIGINT before the control stage took the signals over (reading the state):
                # with handle_signals, a first SIGINT is a stop, and nothing has started yet.
                if not handle_signals:
                    raise
                logger.warning("Shutdown requested (SIGINT) during start-up: nothing was started.")
                self._stop_signal = signal.SIGINT
            finally:
                self._prepare_scope = None
        if prepared is None:
            # Stopped during start-up: nothing ran and nothing was written.
            self.last_counters = RunCounters()
            task_status.started()
            return
        run, eval_send, eval_receive = prepared
        self._run = run
        self._starting = False
        if self.settings is not configured:
            # Resized during start-up (from any thread, on this loop): the run was built
            # from the settings as they were; it starts with the new ones.
            self._resize_run(run, configured, self.settings, self._startup_resize_reason)
        if self._stop_before_start is not None:
            if self._stop_before_start == "force":
                run.stop.cancel_everything()
            else:
                run.stop.request()
            self._stop_before_start = None
        try:
            try:
                await self._run_stages(run, eval_send, eval_receive, handle_signals, task_status)
            except Exception as exc:
                if run.observers.raised is None:
                    raise
                # The observer's error came first; what the winding-down stages raised after
                # it stays visible on it.
                run.observers.raised.add_note(f"while the run ended, a stage raised {exc!r}")
            _raise_observer_error(run)
        except BaseException as exc:
            self._finish(run, exc)
            raise
        self._finish(run, None)
        _raise_observer_error(run)  # one that raised while the final state was saved

    def _finish(self, run: PipelineRun, failure: BaseException | None) -> None:
        """Keep the run's last view and counters, then save its state (`close_run`)."""
        # The last view first: a thread reading statistics() never finds neither.
        self._last_statistics = run.statistics(self.settings, running=False, workers_running=0)
        self._stop_signal = run.stop.signal
        self._run = None
        self._rollouts = None
        self._resize_queue = None
        self._extensions = []
        self.last_counters = run.counters
        close_run(run, failure)

    async def _run_stages(
        self,
        run: PipelineRun,
        eval_send: MemoryObjectSendStream[int],
        eval_receive: MemoryObjectReceiveStream[int],
        handle_signals: bool,
        task_status: TaskStatus[None],
    ) -> None:
        settings = self.settings

        def live() -> PipelineSettings:
            """The settings in force: a resize replaces them while the stages run."""
            return self.settings

        groups = GroupQueue[Delivered](settings.groups_capacity)
        send, receive = groups.send_end, groups.receive_end
        self._resize_queue = groups.resize
        rollouts = RolloutStage(
            send=send, context=run.context, settings=live, source=run.source,
            gate=run.gate, fates=run.fates, observers=run.observers, stop=run.stop,
            leases=run.leases, state=run.state, freshness=run.freshness,
            in_flight_updates=run.in_flight_updates, clock=run.now,
        )
        self._rollouts = rollouts
        control = ControlStage(run.stop, handle_signals=handle_signals)
        training = TrainingStage(
            receive=receive, eval_send=eval_send, context=run.context, settings=live,
            state=run.state, gate=run.gate, fates=run.fates, observers=run.observers,
            stop=run.stop, calls=run.calls, eval_leases=run.eval_leases,
            checkpoints=CheckpointBook(
                run.context, settings, run.state, run.leases, run.calls,
                run.freshness.retention_window,
            ),
            freshness=run.freshness,
            make_metrics=functools.partial(
                TrainMetrics, counters=run.counters, tally_base=run.tally_base,
                score_references=run.score_references, freshness=run.freshness,
            ),
            counters=run.counters, clock=run.now, persist=run.persist,
            end_rollouts=run.end_rollouts_now,
        )
        stages: list[Stage] = [
            rollouts,
            training,
            EvalStage(
                receive=eval_receive, context=run.context, state=run.state, stop=run.stop,
                calls=run.calls, leases=run.leases, eval_leases=run.eval_leases,
                emit=run.emit, clock=run.now, persist=run.persist,
            ),
            StatusStage(run.status, start_step=run.context.start_step, finished=run.stop.finished),
        ]
        view = RunView(
            model=self.model, settings=live, counters=run.counters, gate=run.gate,
            calls=run.calls, stop=run.stop, bridge=run.context.bridge, status=run.status,
            clock=run.now, emit=run.emit, observe=run.observers.add, statistics=self.statistics,
            resize=self.resize, rollouts_in_flight=rollouts.in_flight,
            workers_running=lambda: rollouts.workers_running, ready=lambda: len(training.ready),
            queue=groups.statistics,
        )
        self._extensions = run_extensions(
            settings, self.autotune, self.rollout_executor, self.extensions
        )
        # An extension's stage ends with the run's own stages at the latest: one that never
        # returns must not keep train() from returning.
        stages += [
            BoundedStage(s, run.stop.finished)
            for s in (ext.stage(view) for ext in self._extensions) if s is not None
        ]
        with run.stop.run_scope as run_scope:
            async with anyio.create_task_group() as tg:
                run.eval_leases.attach(tg)
                # Signals first: the other stages start once a SIGINT is a stop.
                await tg.start(
                    run_stage, run, control.name, control, name=f"art_trio {control.name} stage"
                )
                for stage in stages:
                    # Named for the stall watchdog's task tree ("art_trio training stage").
                    tg.start_soon(run_stage, run, stage.name, stage,
                                  name=f"art_trio {stage.name} stage")
                task_status.started()
        finalize = backend_hook(self.backend, "finalize_training_session")
        if finalize is not None and run.counters.steps and not run_scope.cancel_called:
            # ART 0.5.20+'s end of a training session (the Megatron backend's), once every
            # stage ended without an error and this run trained a step; not after a forced
            # stop. Its metrics feed only ART's autotuner attachments, which art_trio has not.
            await run.context.bridge.call(finalize, self.model)

    def statistics(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> RunStatistics:
        """The run as it is now: an immutable snapshot, cheap enough to take every step.

        During `train()` it is live; afterwards it is the finished run's last view; before
        the first `train()` it shows the configured sizes and zero counts.

        Callable from any thread (a metrics exporter, a watchdog): from another thread than
        the run's event loop, the snapshot is taken on the loop, between two tasks' steps,
        so it is one consistent instant; the caller waits for it for up to `timeout`
        seconds, then gets `art_trio.LoopUnresponsive` (something is blocking the loop).
        """
        loop = self._loop
        if loop is not None and not loop.in_loop_thread():
            try:
                return loop.call(
                    self.statistics, timeout=timeout, what="trainer.statistics()"
                )
            except _LoopClosed:
                pass  # the run ended meanwhile: its last view follows
            except LoopUnresponsive:
                if self._loop is loop:
                    raise
                # The run ended while the call waited (a loop that closes drops what was
                # scheduled on it): its last view follows.
        if self._run is not None:
            rollouts = self._rollouts
            return self._run.statistics(
                self.settings,
                running=True,
                workers_running=rollouts.workers_running if rollouts else 0,
            )
        if self._last_statistics is not None and not self._starting:
            return self._last_statistics
        # Before the first run: the configured sizes, and the counters of a run that has
        # seen no event.
        return compose_statistics(
            running=False, settings=self.settings, fold=CounterFold(), gate=None,
            workers_running=0, elapsed_s=0.0, now=0.0,
        )

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
        loop = self._loop
        if loop is not None and not loop.in_loop_thread():
            return loop.call(
                functools.partial(
                    self.resize, num_rollout_workers=num_rollout_workers,
                    min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                    queue_maxsize=queue_maxsize, reason=reason,
                ),
                timeout=DEFAULT_TIMEOUT_S, what="trainer.resize()",
            )
        for name, value in (
            ("num_rollout_workers", num_rollout_workers),
            ("min_batch_size", min_batch_size),
            ("max_batch_size", max_batch_size),
            ("queue_maxsize", queue_maxsize),
        ):
            # Before anything compares or counts with it (inf workers started workers
            # forever); None keeps the current value.
            problem = count_error(name, value, optional=True)
            if problem is not None:
                raise ValueError(f"resize: {problem}; nothing was changed")
        run, s = self._run, self.settings
        workers = _fit_executor(
            self.rollout_executor,
            s.sizes.num_rollout_workers if num_rollout_workers is None else num_rollout_workers,
            explicit=num_rollout_workers is not None,
        )
        # Checked by PipelineSettings itself (ValueError), as the constructor's values are. A
        # running channel has a capacity now, which stays unless a new one is given.
        current_queue = s.groups_capacity if run is not None else s.sizes.queue_maxsize
        resized = s.replace(
            num_rollout_workers=workers,
            min_batch_size=s.sizes.min_batch_size if min_batch_size is None else min_batch_size,
            max_batch_size=s.sizes.max_batch_size if max_batch_size is None else max_batch_size,
            queue_maxsize=current_queue if queue_maxsize is None else queue_maxsize,
        )
        # The one settings object: the run's while one goes (the next run starts with them).
        self.settings = resized
        if run is None:
            # Before train(), or during its start-up (on its loop): the run being built
            # starts with these (see _train_in_bridge).
            self._startup_resize_reason = reason
            return self.statistics()
        self._resize_run(run, s, resized, reason)
        for extension in self._extensions:
            # The user's values win over an autotuner's (it stops changing what they set).
            told = getattr(extension, "resized", None)
            if told is not None:
                told(num_rollout_workers=num_rollout_workers,
                     min_batch_size=min_batch_size, max_batch_size=max_batch_size)
        return self.statistics()

    def _resize_run(
        self, run: PipelineRun, s: PipelineSettings, resized: PipelineSettings, reason: str
    ) -> None:
        run.gate.resize(resized.sizes.max_batch_size)
        if resized.groups_capacity != s.groups_capacity and self._resize_queue is not None:
            self._resize_queue(resized.groups_capacity)
        if self._rollouts is not None:
            self._rollouts.resize(resized.sizes.num_rollout_workers)
        run.emit(
            Resized(
                resized.sizes.num_rollout_workers,
                resized.sizes.min_batch_size,
                resized.sizes.max_batch_size,
                resized.groups_capacity,
                reason,
            )
        )

    @property
    def stop_signal(self) -> signal.Signals | None:
        """The signal (SIGINT or SIGTERM) that stopped the last `train()`, None if none did.

        `train()` returns normally after a signal's clean stop; a program that should end as
        an interrupted one does (exit status 130 for SIGINT) checks this:
        `if trainer.stop_signal: sys.exit(128 + trainer.stop_signal)`.
        """
        run = self._run
        number = run.stop.signal if run is not None else self._stop_signal
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
        runs; before `train()` starts, it makes the next `train()` stop at once. Safe
        from any thread at any moment, start-up included (it is then handed to the loop too).
        """
        loop = self._loop
        if loop is not None and not loop.in_loop_thread():
            try:
                loop.call(
                    functools.partial(self.request_stop, force=force),
                    timeout=DEFAULT_TIMEOUT_S, what="trainer.request_stop()",
                )
            except _LoopClosed:
                pass  # the run has ended: nothing left to stop
            return
        if self._run is None:
            if self._stop_before_start != "force":
                self._stop_before_start = "force" if force else "graceful"
            # Only on the loop's thread (another thread gets here only while no train()
            # has handed it a loop: then the flag alone is honoured when the run is built).
            if self._prepare_scope is not None and loop is not None:
                self._prepare_scope.cancel()
            return
        if force:
            self._run.stop.cancel_everything()
        else:
            self._run.stop.request()

    # -- internals -----------------------------------------------------------------------

    def _validate_backend_support(self) -> None:
        # A method, as ART's trainer has it (tests stub it to run a LocalBackend double).
        check_backend_support(self.backend, self.model, self.settings)


# What `inspect` (and so ART-parity tests, docs and IDEs without PEP 692) shows: every
# settings keyword spelt out with its default, from the declarations.
spell_out_settings(PipelineTrainer.__init__)


#: Objects the interpreter itself froze at start-up. CPython 3.12 reports a few hundred
#: (static tuples; 3.11 and 3.13 report none); they count as nobody's freeze, so a run may
#: freeze and unfreeze over them. Elsewhere any frozen object is someone's to keep.
_FROZEN_BY_INTERPRETER = gc.get_freeze_count() if sys.version_info[:2] == (3, 12) else 0


@contextmanager
def _long_lived_objects_frozen() -> Iterator[None]:
    """Keep the cyclic garbage collector off what existed before the run, for the run.

    A run allocates a few objects per rollout (an asyncio task per bridged call, a group, its
    trajectories); each full collection then walks everything the process holds, ART's
    imports included (about 250k objects, ~0.18 s a pass). Measured with the kernel split off
    (`art-trio bench --workloads overhead-b32`, seeds 0-1, twice): the bridged path does
    6,581-6,985 groups/s with the freeze and 5,749-6,002 without (143-153 against 167-174 CPU
    us a group); anyio on asyncio is the same either way. Objects from before `train()` are
    modules, the model and the user's own: frozen for the run (freed by reference counting
    as ever; only cyclic garbage among them waits) and handed back to the collector after.
    Skipped if the host froze objects itself (it may rely on that: `gc.unfreeze()` releases
    every frozen object). On Python 3.12 the interpreter's own start-up freeze is not the
    host's: the run's unfreeze hands those few hundred tuples to the collector as well.
    """
    if gc.get_freeze_count() > _FROZEN_BY_INTERPRETER or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _raise_observer_error(run: PipelineRun) -> None:
    """Raise the user observer's error that ended the run (the stages ended as at a forced
    stop): in a group, as a stage's error reaches the caller."""
    if run.observers.raised is not None:
        raise ExceptionGroup("an observer of the run raised", [run.observers.raised])


def _check_extensions(extensions: Sequence[object], progress_keeper: object) -> None:
    """An object that is not an extension fails here, not when a run starts."""
    for extension in extensions:
        if not callable(getattr(extension, "stage", None)):
            raise TypeError(
                "each of extensions must be a StageExtension (a `stage(run)` method returning "
                f"a stage or None), got {type(extension).__name__}"
            )
    if progress_keeper is not None and not callable(progress_keeper):
        raise TypeError(
            "progress_keeper must be a function of the model returning a ProgressKeeper, got "
            f"{type(progress_keeper).__name__}"
        )


def _check_callbacks(rollout_fn: object, eval_fn: object, scenarios: object) -> None:
    """Catch the usual slips at construction, not as a failure per rollout later."""
    for name, fn in (("rollout_fn", rollout_fn), ("eval_fn", eval_fn)):
        if fn is None and name == "eval_fn":
            continue
        if not callable(fn):
            raise TypeError(
                f"{name} must be callable and return an awaitable (an async function), got "
                f"{type(fn).__name__}"
            )
        # A plain `def` is fine if it returns an awaitable (ART's own tests pass lambdas
        # around coroutines); one that does not is caught at its first call.
    if not isinstance(scenarios, (Iterable, AsyncIterator)) or isinstance(scenarios, (str, bytes)):
        raise TypeError(
            "scenarios must be an iterable (a list, a generator) or an async iterator of "
            f"scenarios, got {type(scenarios).__name__}"
        )
