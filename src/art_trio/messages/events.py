"""Watching a run from outside: events as they happen, and `RunStatistics` snapshots.

`trainer.add_observer(callback)` registers a plain function called with each event, in the
trainer's own task, the moment it happens; `trainer.statistics()` returns a `RunStatistics`
at any time. Both are read-only views: nothing a caller does with them changes the run.

The events are the run's one record of what happened. The run's own bookkeeping is made of
observers too: the counters (`fates.CounterFold`, behind `RunStatistics` and
`trainer.last_counters`) and the status line (`status.StatusReporter`) fold the events and
nothing else changes their figures. They are registered before the user's observers, so a
user's observer that raises never leaves them behind. Events are built on every path, so
each is a frozen, slotted dataclass whose `__init__` writes its slots directly
(`values.cheap_init`: about half the cost of a frozen dataclass's own).

An observer must return quickly and must not await (it runs inside the pipeline's hot path,
and is not awaited); an exception it raises ends the run like a failing stage, though never in
the middle of the state change that emitted the event (see `Observers`).

The first error wins: once the run is failing (a stage raised, or an observer did), an
observer that raises while the run winds down (scenarios settled as dropped, the channel
closed) does not replace that error; its own is logged and noted on the first one.

Over 400 lines because it is one vocabulary: nineteen small event classes, the observer
registry and `RunStatistics`, each documented where users read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import sync_callback_error
from .values import Fate, cheap_init

logger = logging.getLogger("art_trio")

@cheap_init
@dataclass(frozen=True, slots=True)
class ScenarioSettled:
    """A scenario's fate was recorded (once per scenario taken)."""

    scenario_index: int
    fate: Fate
    #: Seconds its rollout ran (0 if it did not run to the end: dropped, errored).
    rollout_s: float
    #: Its group had been queued for the trainer (and leaves the queue now), unless it was in
    #: a batch: those groups left the queue with their batch (`BatchTaken`), whether it
    #: trained or its `backend.train` call ended without a result.
    queued: bool = False


@cheap_init
@dataclass(frozen=True, slots=True)
class GroupQueued:
    """A rollout worker handed a group to the trainer's channel."""

    scenario_index: int
    #: Groups handed to the trainer and not yet in a batch or discarded, this one included:
    #: the gate's count (`PolicyGate.queued`), carried so no observer keeps a second tally.
    queued: int


@cheap_init
@dataclass(frozen=True, slots=True)
class BatchTaken:
    """The trainer took `batch_size` queued groups as the batch that produces `step`."""

    step: int
    batch_size: int


@cheap_init
@dataclass(frozen=True, slots=True)
class GroupReceived:
    """The trainer took a group out of the rollout channel."""

    scenario_index: int
    #: The group's `initial_policy_version` (None if its trajectories carry none).
    policy_version: int | None
    #: Groups in the channel just before this one was taken out (its occupancy).
    groups_in_channel: int


@cheap_init
@dataclass(frozen=True, slots=True)
class ChannelClosed:
    """The trainer stopped receiving; `groups_left` were still in the channel's buffer (dropped,
    as are the groups of senders blocked on it and those taken out but not yet trained)."""

    groups_left: int


@cheap_init
@dataclass(frozen=True, slots=True)
class StepTrained:
    """`backend.train` produced `step` from a batch of `batch_size` groups."""

    step: int
    batch_size: int
    scenario_indices: tuple[int, ...]
    #: Per group: versions between the policy trained from and the group's version.
    staleness: tuple[int, ...]
    #: Seconds from the start of collecting the batch to the end of the step, and inside
    #: `backend.train`.
    wall_s: float
    train_s: float
    #: The batch's mean reward over its trajectories (None if it had none), the mean of its
    #: groups' reward standard deviations, and how many of its groups scored all alike.
    reward_mean: float | None = None
    reward_std_mean: float = 0.0
    zero_variance_groups: int = 0
    #: The batch's tokens x their policy age (each token aged by the policy that produced
    #: it), and its tokens: `freshness.token_ages`.
    token_ages: tuple[float, float] = (0.0, 0.0)
    #: Per group (as `scenario_indices`): its tokens' mean policy age in steps, each token
    #: aged by the policy that produced it (None: no token versions known).
    token_staleness: tuple[float | None, ...] = ()
    #: Seconds of `wall_s` spent waiting for the batch's groups (collecting it): the
    #: trainer's idle time, as ART's `time/step_collect_batch_s`.
    idle_s: float = 0.0


@cheap_init
@dataclass(frozen=True, slots=True)
class PolicyPublished:
    """Rollouts sample `version` from now on."""

    version: int


@cheap_init
@dataclass(frozen=True, slots=True)
class Resized:
    """The run's size changed while it ran (`trainer.resize`, or the autotuner)."""

    num_rollout_workers: int
    min_batch_size: int
    max_batch_size: int
    queue_capacity: int
    reason: str


@cheap_init
@dataclass(frozen=True, slots=True)
class RolloutStarted:
    """A rollout worker took scenario `scenario_index` from the source and starts its rollout."""

    scenario_index: int


@cheap_init
@dataclass(frozen=True, slots=True)
class RolloutEnded:
    """A rollout ended, whatever its end (its fate follows or came first, as `ScenarioSettled`).

    `spent_s`: seconds it ran (what inference cost). `completed_s` and `idle_s`: if it
    completed with a group, its seconds and the worker's idle seconds before it (else 0).
    """

    scenario_index: int
    spent_s: float
    completed_s: float = 0.0
    idle_s: float = 0.0


@cheap_init
@dataclass(frozen=True, slots=True)
class RolloutGivenBack:
    """A rollout was lost with its executor worker; its scenario went back to the source and
    will be taken again (that take is not counted twice)."""

    scenario_index: int


@cheap_init
@dataclass(frozen=True, slots=True)
class HandOverBlocked:
    """A worker waited `seconds` for room in the full groups channel."""

    seconds: float


@cheap_init
@dataclass(frozen=True, slots=True)
class EmptyGroupReceived:
    """The trainer received a group with no trajectories (settled as zero variance)."""

    scenario_index: int


@cheap_init
@dataclass(frozen=True, slots=True)
class TrainCallStarted:
    """`backend.train` is about to be called for the batch that produces `step`."""

    step: int
    at: float


@cheap_init
@dataclass(frozen=True, slots=True)
class TrainCallEnded:
    """The `backend.train` call for `step` ended (with a result or not) after `train_s`."""

    step: int
    train_s: float


@cheap_init
@dataclass(frozen=True, slots=True)
class Collapsed:
    """The training stage stopped the run: `held` zero-variance groups in a row."""

    held: int


@cheap_init
@dataclass(frozen=True, slots=True)
class EvalStarted:
    """The eval of `step` started."""

    step: int


@cheap_init
@dataclass(frozen=True, slots=True)
class EvalEnded:
    """The eval of `step` ended: `completed` if it ran to the end (its mean reward, None if
    it had none), else it failed or was cancelled."""

    step: int
    completed: bool
    reward: float | None = None


class StallNotice(Protocol):
    """What the run's own observers read of a stall report (the watchdog's `StallReport`,
    `art_trio.watchdog`): the counters count first reports, the status line shows the
    headline."""

    @property
    def repeat(self) -> int:
        """1 for a stall's first report, 2 for the next while it persists, ..."""

    def headline(self) -> str:
        """One line: how long, and what the run waits on."""


@cheap_init
@dataclass(frozen=True, slots=True)
class Stalled:
    """The run has not moved for `seconds` (no rollout ended, no step trained, no eval
    ended), or its event loop did not answer: the watchdog's report (`report`, a
    `art_trio.watchdog.StallReport`), once per stall and again while it persists."""

    seconds: float
    report: StallNotice


RunEvent = (
    ScenarioSettled
    | GroupQueued
    | GroupReceived
    | BatchTaken
    | ChannelClosed
    | StepTrained
    | PolicyPublished
    | Resized
    | RolloutStarted
    | RolloutEnded
    | RolloutGivenBack
    | HandOverBlocked
    | EmptyGroupReceived
    | TrainCallStarted
    | TrainCallEnded
    | Collapsed
    | EvalStarted
    | EvalEnded
    | Stalled
)
Observer = Callable[[RunEvent], None]


#: How the run's own observers fold events: a handler per event type they follow.
Routes = Mapping[type, Callable[[Any], None]]


def _nothing() -> None:
    pass


class Observers:
    """The observers of one trainer: the run's own (folding its record), then the user's.

    `emit` is always callable. The run's own observers are set by `begin_run` for each run,
    as routes (a handler per event type: an event goes straight to the handlers that fold
    it, which keeps the always-built events cheap); the user's (`add`) stay from run to run
    and hear every event. `watched` says whether a user observes (a figure only an event
    reports, not the run's record, is measured only then).

    A user observer's exception never leaves `emit`: events are emitted in the middle of
    state changes (a rollout taken, a batch handed to the backend), and an exception raised
    there would skip the code that settles the scenario's fate. The first one is kept as
    `raised`, the run is told to end (`begin_run`'s `on_raise`: a forced stop, so every
    taken scenario is settled the usual way) and the trainer raises it once the stages
    have ended.
    """

    def __init__(self) -> None:
        self._routes: dict[type, tuple[Callable[[Any], None], ...]] = {}
        self._callbacks: list[Observer] = []
        self._users: tuple[Observer, ...] = ()
        self.watched = False
        #: The running run's first error (None while it is not failing; see `note_failure`).
        self.failure: BaseException | None = None
        #: The user observer's exception that ends the run (None while none has).
        self.raised: Exception | None = None
        self._on_raise: Callable[[], None] = _nothing
        self._late_errors = 0

    def begin_run(
        self, internal: tuple[Routes, ...] = (), on_raise: Callable[[], None] | None = None
    ) -> None:
        """A new run starts, folded by `internal` (before the user's, in order): nothing has
        failed yet. `on_raise` ends the run when a user observer raises first."""
        self.failure = None
        self.raised = None
        self._on_raise = on_raise or _nothing
        self._late_errors = 0
        routes: dict[type, list[Callable[[Any], None]]] = {}
        for table in internal:
            for kind, handler in table.items():
                routes.setdefault(kind, []).append(handler)
        self._routes = {kind: tuple(handlers) for kind, handlers in routes.items()}

    def _rebuild(self) -> None:
        self._users = tuple(self._callbacks)
        self.watched = bool(self._users)

    def note_failure(self, exc: BaseException) -> None:
        """The run is failing with `exc`, unless it already was (the first error wins);
        cancellation is not a failure."""
        if self.failure is None and isinstance(exc, Exception):
            self.failure = exc

    def add(self, callback: Observer) -> Callable[[], None]:
        if not callable(callback):
            raise TypeError(f"an observer must be callable, got {type(callback).__name__}")
        self._callbacks.append(callback)
        self._rebuild()

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
            self._rebuild()

        return remove

    def emit(self, event: RunEvent) -> None:
        """Fold `event` into the run's record, then hand it to every user observer. Never
        raises for a user observer (see the class): the first error ends the run, a later
        one is logged."""
        for handler in self._routes.get(type(event), ()):
            handler(event)
        for callback in self._users:
            try:
                callback(event)
            except BaseException as raised:  # (a synchronous call: all of it is the observer's)
                exc = sync_callback_error(raised, callback)
                failure = self.failure
                if failure is None or failure is exc:
                    self._first(callback, event, exc)
                else:
                    self._late(failure, callback, event, exc)

    def _first(self, callback: Observer, event: RunEvent, exc: Exception) -> None:
        """A user observer raised first: the run ends with its error, raised by `train()`."""
        self.failure = self.raised = exc
        exc.add_note(f"raised by observer {callback!r} on {type(event).__name__}")
        logger.error(
            "Observer %r raised on %s: %s: %s; stopping the run.",
            callback, type(event).__name__, type(exc).__name__, exc,
        )
        self._on_raise()

    def _late(
        self, failure: BaseException, callback: Observer, event: RunEvent, exc: Exception
    ) -> None:
        """An observer raised while the run was already failing: keep it visible, raise the
        first error."""
        self._late_errors += 1
        if self._late_errors == 1:
            logger.error(
                "An observer raised while the run was ending after an earlier error; the "
                "earlier error is the one train() raises. Observer %r on %r raised:",
                callback, event, exc_info=exc,
            )
            failure.add_note(
                f"while the run was ending, observer {callback!r} also raised "
                f"{type(exc).__name__}: {exc} (on {type(event).__name__}); logged on the "
                "'art_trio' logger"
            )
        else:
            logger.debug("observer %r raised again while the run was ending: %r", callback, exc)


@dataclass(frozen=True, slots=True)
class RunStatistics:
    """A run seen at one instant (`trainer.statistics()`); immutable.

    Fate counts cover scenarios taken by this `train()` call; seconds are on the event
    loop's clock (virtual under trio's MockClock).
    """

    #: True while `train()` runs.
    running: bool
    #: True once the training stage stopped the run as collapsed (zero-variance groups).
    collapsed: bool
    policy_version: int
    #: Steps trained by this `train()` call.
    steps: int
    num_rollout_workers: int
    min_batch_size: int
    max_batch_size: int
    #: Capacity of the channel from rollout workers to the trainer.
    queue_capacity: int
    rollouts_in_flight: int
    #: Groups handed to the trainer and not yet trained or discarded (channel and ready).
    groups_queued: int
    taken: int
    trained: int
    stale: int
    stale_cancelled: int
    zero_variance: int
    errored: int
    dropped_at_stop: int
    rollouts_started: int
    rollouts_lost: int
    #: Seconds since `train()` started the stages.
    elapsed_s: float
    #: Seconds inside `backend.train`, and since the first step started.
    train_s: float
    since_first_step_s: float
    #: `train_s / since_first_step_s` (None before the first step ends).
    trainer_utilization: float | None
    #: Rollout-seconds spent, every rollout counted whatever its end: what inference cost.
    rollout_s_spent: float
    #: The gate's measured mean rollout latency and step period (None until measured).
    rollout_latency_s: float | None
    step_period_s: float | None
    #: Trained groups by versions behind the policy they were trained from.
    staleness: Mapping[int, int]
    #: Stalls the watchdog reported (each stall once, however long it persisted).
    stalls: int = 0
    #: Token-weighted mean policy age of the trained tokens: each token aged by the policy
    #: that produced it (per-token where the server reports spans, as with in-flight
    #: updates; else its trajectory's start version). None before a token is trained.
    token_policy_age: float | None = None
    #: Seconds the trainer waited for groups (collecting its batches, the first one's
    #: included: the sum of each step's `StepTrained.idle_s`).
    idle_s: float = 0.0

    @property
    def rollout_s_per_trained_group(self) -> float | None:
        """What a trained group cost in rollout time (None before any is trained)."""
        return self.rollout_s_spent / self.trained if self.trained else None
