"""Watching a run from outside: events as they happen, and `RunStatistics` snapshots.

`trainer.add_observer(callback)` registers a plain function called with each event, in the
trainer's own task, the moment it happens; `trainer.statistics()` returns a `RunStatistics`
at any time. Both are read-only views: nothing a caller does with them changes the run.

An observer must return quickly and must not await (it runs inside the pipeline's hot path,
and is not awaited); an exception it raises ends the run like a failing stage. While no
observer is registered, no event object is even built.

The first error wins: once the run is failing (a stage raised, or an observer did), an
observer that raises while the run winds down (scenarios settled as dropped, the channel
closed) does not replace that error; its own is logged and noted on the first one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .messages import Fate

logger = logging.getLogger("art_trio")


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


@dataclass(frozen=True, slots=True)
class GroupQueued:
    """A rollout worker handed a group to the trainer's channel."""

    scenario_index: int


@dataclass(frozen=True, slots=True)
class BatchTaken:
    """The trainer took `batch_size` queued groups as the batch that produces `step`."""

    step: int
    batch_size: int


@dataclass(frozen=True, slots=True)
class GroupReceived:
    """The trainer took a group out of the rollout channel."""

    scenario_index: int
    #: The group's `initial_policy_version` (None if its trajectories carry none).
    policy_version: int | None
    #: Groups in the channel just before this one was taken out (its occupancy).
    groups_in_channel: int


@dataclass(frozen=True, slots=True)
class ChannelClosed:
    """The trainer stopped receiving; `groups_left` were still in the channel's buffer (dropped,
    as are the groups of senders blocked on it and those taken out but not yet trained)."""

    groups_left: int


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


@dataclass(frozen=True, slots=True)
class PolicyPublished:
    """Rollouts sample `version` from now on."""

    version: int


@dataclass(frozen=True, slots=True)
class Resized:
    """The run's size changed while it ran (`trainer.resize`, or the autotuner)."""

    num_rollout_workers: int
    min_batch_size: int
    max_batch_size: int
    queue_capacity: int
    reason: str


RunEvent = (
    ScenarioSettled
    | GroupQueued
    | GroupReceived
    | BatchTaken
    | ChannelClosed
    | StepTrained
    | PolicyPublished
    | Resized
)
Observer = Callable[[RunEvent], None]


class Observers:
    """The registered observers of one trainer; `emit` is None while there are none."""

    def __init__(self) -> None:
        self._callbacks: list[Observer] = []
        self.emit: Callable[[RunEvent], None] | None = None
        #: The running run's first error (None while it is not failing; see `note_failure`).
        self.failure: BaseException | None = None
        self._late_errors = 0

    def begin_run(self) -> None:
        """A new run starts: nothing has failed yet."""
        self.failure = None
        self._late_errors = 0

    def note_failure(self, exc: BaseException) -> None:
        """The run is failing with `exc`, unless it already was (the first error wins)."""
        if self.failure is None:
            self.failure = exc

    def add(self, callback: Observer) -> Callable[[], None]:
        if not callable(callback):
            raise TypeError(f"an observer must be callable, got {type(callback).__name__}")
        self._callbacks.append(callback)
        self.emit = self._emit

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
            if not self._callbacks:
                self.emit = None

        return remove

    def _emit(self, event: RunEvent) -> None:
        for callback in tuple(self._callbacks):
            try:
                callback(event)
            except Exception as exc:
                failure = self.failure
                if failure is None or failure is exc:
                    self.failure = exc  # the run's first error: it ends the run
                    raise
                self._late(failure, callback, event, exc)

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

    @property
    def rollout_s_per_trained_group(self) -> float | None:
        """What a trained group cost in rollout time (None before any is trained)."""
        return self.rollout_s_spent / self.trained if self.trained else None


__all__ = [
    "BatchTaken",
    "ChannelClosed",
    "GroupQueued",
    "GroupReceived",
    "Observer",
    "Observers",
    "PolicyPublished",
    "Resized",
    "RunEvent",
    "RunStatistics",
    "ScenarioSettled",
    "StepTrained",
]
