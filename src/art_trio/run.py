"""One `train()` call's shared state: what several stages must agree on.

A `PipelineRun` is built fresh by each `train()`, so two trainers (or two runs) share nothing.
Stages talk through channels and own their own state (see stages/); what is left here is
truly shared: the policy gate and its admission policy, the fate record, the resume state,
the stop protocol, the leases on checkpoints in use, and the channels between the stages.
Each stage is given the run and reads the parts it uses; `run.settings` is the settings
object in force (the trainer's `trainer.settings`: a resize replaces both).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import anyio

from .config.settings import PipelineSettings
from .messages.events import Observers, Resized, RunStatistics
from .messages.values import CallInFlight, Delivered, TallyBase
from .observation.fates import CounterFold, FateRecord, RunCounters
from .observation.status import StatusReporter
from .plumbing.bridge.calls import Bridge
from .plumbing.compat import eval_lease, in_flight_updates, rollout_lease
from .plumbing.eval_leases import EvalRetentionLeases
from .plumbing.executor import RolloutExecutor
from .plumbing.group_queue import GroupQueue, loop_primitives
from .plumbing.progress import ProgressKeeper, RunProgress
from .plumbing.source import ScenarioSource
from .plumbing.stop import StopControl
from .policy.admission import AdmissionPolicy
from .policy.gate import PolicyGate

R = TypeVar("R")


class CallsInFlight:
    """What each stage awaits beyond its own loop now: a backend or callback call
    (`backend.train`, `model.log`, a checkpoint hook, the `eval_fn`) or a phase (collecting a
    batch), with when it began. Entered per step or per eval, never per rollout; read by the
    stall watchdog. The longest call that ended feeds `stall_seconds="auto"`.
    """

    __slots__ = ("_calls", "_clock", "longest_s")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._calls: dict[str, list[tuple[str, float]]] = {}
        #: The longest call (not phase) that ended so far, in seconds.
        self.longest_s = 0.0

    @contextmanager
    def track(self, stage: str, call: str, *, phase: bool = False) -> Iterator[None]:
        """`with run.calls.track("training", "backend.train"):` around the awaited call."""
        since = self._clock()
        stack = self._calls.setdefault(stage, [])
        stack.append((call, since))
        try:
            yield
        finally:
            stack.remove((call, since))
            if not phase:
                self.longest_s = max(self.longest_s, self._clock() - since)

    def in_flight(self, now: float) -> tuple[CallInFlight, ...]:
        """Every call in flight, each stage's outermost first."""
        return tuple(
            CallInFlight(stage, call, now - since)
            for stage, stack in self._calls.items()
            for call, since in stack
        )

    def innermost(self, stage: str) -> tuple[str, float] | None:
        """What `stage` awaits now (its innermost call) and since when, or None."""
        stack = self._calls.get(stage)
        return stack[-1] if stack else None


class StepLeases:
    """The steps running rollouts and evals sample from, with how many hold each: retention
    never deletes a leased checkpoint."""

    __slots__ = ("_bridge", "_model", "held")

    def __init__(self, bridge: Bridge, model: Any) -> None:
        self._bridge = bridge
        self._model = model
        #: Step -> how many running rollouts and evals hold it.
        self.held: dict[int, int] = {}

    async def call(
        self,
        step: int,
        fn: Callable[..., Awaitable[R]],
        *args: Any,
        lease: Callable[[Any, int], AbstractAsyncContextManager[Any]] | None,
    ) -> R:
        """Await the user callback `fn(*args)` while holding a lease on `step`'s weights.

        `lease(model, step)` is the backend's lease (`adapter_lease` for rollouts; for evals
        on ART 0.5.20+ `exact_adapter_lease` where the backend has it, see compat.py), held
        for the callback's whole duration, entered where the bridge runs the callback (see
        `Bridge.callback_holding`).
        """
        held = self.held
        held[step] = held.get(step, 0) + 1
        try:
            if lease is None:
                return await self._bridge.callback(fn, *args)
            model = self._model
            return await self._bridge.callback_holding(lambda: lease(model, step), fn, *args)
        finally:
            held[step] -= 1
            if held[step] <= 0:
                del held[step]


class RunConfiguration(Protocol):
    """What a run is built from: its trainer's configuration (`PipelineTrainer` has it)."""

    model: Any
    backend: Any
    settings: PipelineSettings
    rollout_fn: Any
    eval_fn: Any
    config: Any
    rollout_executor: Any
    _scenarios: Any
    _observers: Observers
    _score_references: tuple[float | None, float | None]


class PipelineRun:
    """State shared by the stages of one `train()` call."""

    def __init__(
        self,
        configured: RunConfiguration,
        *,
        bridge: Bridge,
        keeper: ProgressKeeper,
        state: RunProgress,
        start_step: int,
        admission: AdmissionPolicy,
    ) -> None:
        model, backend, settings = configured.model, configured.backend, configured.settings
        # The run's fixed parts: what every stage reads and nobody changes while it goes.
        self.model = model
        self.backend = backend
        self.bridge = bridge
        self.rollout_fn = configured.rollout_fn
        self.eval_fn = configured.eval_fn
        self.config = configured.config
        #: Where rollouts run; None runs `rollout_fn` directly (no executor frame per rollout).
        self.executor: RolloutExecutor | None = configured.rollout_executor
        self.start_step = start_step
        #: The backend's leases on a step's weights for a rollout, and for an eval (None:
        #: none), as the installed ART line uses them.
        self.rollout_lease = rollout_lease(backend)
        self.eval_lease = eval_lease(backend)
        #: The settings in force (`resize` replaces them while the run goes).
        self.settings = settings
        self.state = state
        self.keeper = keeper
        self.source: ScenarioSource[Any] = ScenarioSource(configured._scenarios, state, bridge)
        #: The run's record: its events, folded by the counters and the status line first
        #: (registered before the user's observers), then heard by the user's.
        self.fold = CounterFold()
        self.status = StatusReporter(
            get_scenario_offset=lambda: self.source.position,
            log_interval_seconds=settings.status.log_interval_seconds,
            status_ewa_alpha=settings.status.status_ewa_alpha,
            total_scenarios=settings.status.total_scenarios,
            num_workers=settings.sizes.num_rollout_workers,
            clock=anyio.current_time,
            counters=self.fold,
        )
        self.observers = configured._observers
        self.freshness = settings.freshness.rule
        #: The backend updates weights under running rollouts (their tokens span policies).
        self.in_flight_updates = in_flight_updates(backend, model)
        # The loop's own clock (the stages' `clock`): anyio.current_time() looks the backend
        # up on every call, and the stages read the time several times per rollout.
        clock, new_event = loop_primitives()
        self.now = self._clock = clock
        self.started_at = self._clock()
        #: The calls and phases each stage awaits now (the stall watchdog reads them).
        self.calls = CallsInFlight(self._clock)
        self.gate = (admission.gate_class or PolicyGate)(
            start_step=start_step,
            max_steps_off_policy=self.freshness.window,
            cancel_window=self.freshness.cancel_window(self.in_flight_updates),
            max_batch_size=settings.sizes.max_batch_size,
            policy=admission,
            clock=self._clock,
            new_event=new_event,
        )
        # A user observer that raises ends the run as a forced stop would (see Observers).
        self.stop = StopControl(settings.shutdown.shutdown_grace_seconds)
        self.stop.on_stop(self.gate.close)
        self.stop.on_stop(self.source.close)
        self.observers.begin_run(
            internal=(self.fold.routes, self.status.routes), on_raise=self.stop.cancel_everything
        )
        #: Tell the observers (the counters, the status line, then the user's).
        self.emit = self.observers.emit
        self.fates = FateRecord(ledger=state.ledger, gate=self.gate, observers=self.observers)
        #: Steps a running rollout or eval samples from, with how many hold each.
        self.leases = StepLeases(bridge, model)
        #: The backend's `adapter_retention_lease` on each step awaiting eval (if it has one).
        self.eval_leases = EvalRetentionLeases(backend, model, bridge)
        #: The persisted tallies as this run found them: earlier runs' share of the totals.
        self.tally_base = TallyBase(
            state.accepted_trainable_groups,
            state.discarded_stale_groups,
            state.discarded_zero_variance_groups,
        )
        #: ART 0.5.20's objective-score references (groups per step, rollouts per group).
        self.score_references = configured._score_references
        #: The groups channel, rollout workers to the training stage.
        self.groups = GroupQueue[Delivered](settings.groups_capacity)
        #: The steps to evaluate, training stage (and start-up) to the eval stage.
        self.eval_send, self.eval_receive = anyio.create_memory_object_stream[int](math.inf)
        #: The rollout workers running now, by id (the rollout stage starts and ends them).
        self.workers: set[int] = set()
        #: Starts or retires workers to a count: the rollout stage's, once it is built (until
        #: then there is nothing to change: it starts as many as the settings say).
        self.resize_workers: Callable[[int], None] = lambda count: None

    @property
    def counters(self) -> RunCounters:
        """The run's counters, as the events folded them so far (read them; never write)."""
        return self.fold.counters

    # -- stopping ------------------------------------------------------------------------

    def end_rollouts_now(self) -> None:
        """The run ended on its own: admit nothing more and cancel rollouts in flight."""
        self.gate.close()
        self.source.close()
        self.stop.rollout_scope.cancel()

    # -- views ---------------------------------------------------------------------------

    def statistics(self, *, running: bool) -> RunStatistics:
        """The run now: the folded counters, the gate's figures, the settings in force."""
        return compose_statistics(
            running=running,
            settings=self.settings,
            fold=self.fold,
            gate=self.gate,
            workers_running=len(self.workers),
            elapsed_s=self._clock() - self.started_at,
            now=self._clock(),
        )

    def resize(self, resized: PipelineSettings, reason: str) -> None:
        """Make `resized` the settings in force: the gate's batch size, the channel's
        capacity and the rollout workers follow at once."""
        self.settings = resized
        sizes = resized.sizes
        self.gate.resize(sizes.max_batch_size)
        self.groups.resize(resized.groups_capacity)
        self.resize_workers(sizes.num_rollout_workers)
        self.emit(
            Resized(
                sizes.num_rollout_workers,
                sizes.min_batch_size,
                sizes.max_batch_size,
                resized.groups_capacity,
                reason,
            )
        )

    # -- persistence ---------------------------------------------------------------------

    def sync_tallies(self) -> None:
        """Carry this run's counts into ART 0.5.20's persisted tallies (after each step)."""
        base, counters, state = self.tally_base, self.counters, self.state
        state.set_tallies(
            base.accepted + counters.trained,
            base.stale + counters.stale - counters.stale_cancelled,
            base.zero_variance + counters.zero_variance,
        )

    def persist(self) -> None:
        """Record the progress's changes (cheap: a durable store appends one record)."""
        self.sync_tallies()
        self.keeper.record(self.state)

    def snapshot(self) -> None:
        """Write the whole progress (start and end of a run)."""
        self.sync_tallies()
        self.keeper.snapshot(self.state)


def compose_statistics(
    *,
    running: bool,
    settings: PipelineSettings,
    fold: CounterFold | None = None,
    gate: PolicyGate | None = None,
    workers_running: int = 0,
    elapsed_s: float = 0.0,
    now: float = 0.0,
) -> RunStatistics:
    """`RunStatistics` composed from its owners: the counters folded from the events, the
    gate's figures and the settings in force (before a run: no events, no gate yet).

    Rollouts in flight are the rollouts started and not ended, as the events say, not the
    gate's admission slots: the gate takes a slot for a worker it wakes before that worker
    has taken a scenario (and a worker holds its slot while it takes one): counting slots
    would count scenarios nobody has taken, and a snapshot could show more in flight and
    queued than taken and not settled."""
    fold = CounterFold() if fold is None else fold
    c = fold.counters
    first = fold.first_step_at
    since_first = 0.0 if first is None else now - first
    return RunStatistics(
        running=running,
        collapsed=fold.collapsed,
        policy_version=gate.policy_version if gate is not None else 0,
        steps=c.steps,
        num_rollout_workers=workers_running if running else settings.sizes.num_rollout_workers,
        min_batch_size=settings.sizes.min_batch_size,
        max_batch_size=settings.sizes.max_batch_size,
        queue_capacity=settings.groups_capacity,
        rollouts_in_flight=c.rollouts_started - c.rollouts_ended,
        groups_queued=gate.queued if gate is not None else 0,
        taken=c.taken,
        trained=c.trained,
        stale=c.stale,
        stale_cancelled=c.stale_cancelled,
        zero_variance=c.zero_variance,
        errored=c.errored,
        dropped_at_stop=c.dropped_at_stop,
        rollouts_started=c.rollouts_started,
        rollouts_lost=c.rollouts_lost,
        elapsed_s=elapsed_s,
        train_s=c.train_s,
        since_first_step_s=since_first,
        trainer_utilization=c.train_s / since_first if since_first > 0 and c.steps else None,
        rollout_s_spent=c.spent_rollout_s,
        rollout_latency_s=gate.rollout_latency if gate is not None else None,
        step_period_s=gate.step_period if gate is not None else None,
        staleness=MappingProxyType(dict(c.staleness)),
        stalls=c.stalls,
        token_policy_age=c.token_age_sum / c.trained_tokens if c.trained_tokens else None,
        idle_s=c.idle_s,
    )
