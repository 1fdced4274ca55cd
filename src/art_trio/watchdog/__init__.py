"""The stall watchdog: when a run stops moving, a report of where it waits.

`stage.py` is the watchdog (its docstring: what counts as moving, the two watchers, what a
report does); `report.py` the report and `PipelineStalled`; `tasktree.py` reads the run's task
tree for the report. The trainer composes it when `stall_seconds` is not None (the default is
"auto").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..stages import RunView
from .report import PipelineStalled, StageWait, StallReport, TaskFrame
from .stage import WatchdogStage

__all__ = [
    "PipelineStalled", "StageWait", "StallReport", "StallWatchdog", "TaskFrame", "WatchdogStage",
]


@dataclass(frozen=True)
class StallWatchdog:
    """A `StageExtension`: reports a run that stopped moving, and a blocked event loop."""

    #: Seconds without a rollout, step or eval ending; "auto" derives it from the run.
    stall_seconds: float | str
    #: "log", "raise" (`PipelineStalled`) or "stop" (as `request_stop()`).
    stall_action: str = "log"

    def stage(self, run: RunView) -> WatchdogStage:
        return WatchdogStage(
            stall_seconds=self.stall_seconds, stall_action=self.stall_action,
            counters=run.counters, gate=run.gate, calls=run.calls, stop=run.stop,
            bridge=run.bridge, status=run.status, emit=run.emit, clock=run.clock,
            rollouts_in_flight=run.rollouts_in_flight, workers_running=run.workers_running,
            ready=run.ready, queue=run.queue,
        )
