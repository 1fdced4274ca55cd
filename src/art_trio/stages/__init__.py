"""The pipeline's stages, all of one shape: a `Stage`; and how an extension adds one.

A stage is an object built from the run (`RolloutStage(run)`: it reads the gate, the fate
record, the clock, the settings in force, ... off the `PipelineRun`), whose `__call__` runs
its loop and owns its end of a channel; `name` labels its errors (supervision.py). What a
stage counts goes out as events (the counters fold them). `run_stages` starts each in the
run's task group.

An extension that watches or steers a run (the stall watchdog, the autotuner, one of your
own) is a `StageExtension`: given a `RunView` when a run starts, it returns a stage that the
trainer starts in the same task group as its own, so it ends with the run, and its exception
fails the run as any stage's does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config.settings import PipelineSettings
    from ..messages.events import Observer, RunEvent, RunStatistics
    from ..messages.values import RolloutInFlight
    from ..observation.fates import RunCounters
    from ..observation.status import StatusReporter
    from ..plumbing.bridge.calls import Bridge
    from ..plumbing.group_queue import GroupQueueStatistics
    from ..plumbing.stop import StopControl
    from ..policy.gate import PolicyGate
    from ..run import CallsInFlight


class Stage(Protocol):
    """What the trainer needs of every stage."""

    #: The stage's name, as errors are labelled ("raised in art_trio's rollout stage").
    name: str

    async def __call__(self) -> None:
        """Run until the run ends (or the stage's own work is done)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RunView:
    """A running run as an extension's stage sees it: what it may read, and what it may do.

    Reading is free (counters, the gate, the calls in flight); acting goes through the same
    public paths a user has (`resize`, `stop.request`, `emit` for an event of its own).
    """

    model: Any
    #: The settings in force (a resize replaces them).
    settings: Callable[[], PipelineSettings]
    counters: RunCounters
    gate: PolicyGate
    calls: CallsInFlight
    stop: StopControl
    bridge: Bridge
    status: StatusReporter
    #: The run's clock (virtual under trio's MockClock).
    clock: Callable[[], float]
    emit: Callable[[RunEvent], None]
    #: Adds an observer of this run's events; returns the function that removes it.
    observe: Callable[[Observer], Callable[[], None]]
    statistics: Callable[[], RunStatistics]
    resize: Callable[..., RunStatistics]
    #: The rollouts in flight at a time (for a report of where the run waits).
    rollouts_in_flight: Callable[[float], tuple[RolloutInFlight, ...]]
    workers_running: Callable[[], int]
    #: Groups received by the training stage and not yet in a batch.
    ready: Callable[[], int]
    queue: Callable[[], GroupQueueStatistics]


class StageExtension(Protocol):
    """An extension that runs beside the stages: `PipelineTrainer(..., extensions=[...])`."""

    def stage(self, run: RunView) -> Stage | None:
        """The stage to start for this run (None: nothing to run this time)."""
        ...
