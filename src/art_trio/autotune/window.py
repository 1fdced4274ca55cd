"""What the autotuner measures: a window of steps (`Window`, `measure`), an inference
server's load (`InferenceLoad`, read from vLLM's metrics page) and a judgement (`Decision`).

Plain values computed from two `RunStatistics` snapshots; no policy and no clock.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..messages.events import RunStatistics


@dataclass(frozen=True, slots=True)
class InferenceLoad:
    """An inference server's load at one instant (vLLM's `/metrics`)."""

    running: float
    waiting: float

    @property
    def pressure(self) -> float:
        """Waiting requests per running one (0: nothing queues at the server)."""
        return self.waiting / self.running if self.running > 0 else (1.0 if self.waiting else 0.0)


_VLLM_LINE = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)")


def parse_vllm_metrics(text: str) -> InferenceLoad | None:
    """Running and waiting requests from a vLLM Prometheus page (summed over its engines)."""
    found = {"running": 0.0, "waiting": 0.0}
    matches = [m for m in map(_VLLM_LINE.match, text.splitlines()) if m]
    for match in matches:
        found[match.group(1)] += float(match.group(2))
    return InferenceLoad(**found) if matches else None


@dataclass(frozen=True, slots=True)
class Window:
    """What one window of steps measured (differences of two `RunStatistics`)."""

    start_step: int
    end_step: int
    wall_s: float
    #: The share of the window the trainer did not wait for groups (1 - idle / wall): its
    #: own per-step work (logging, checkpoints) is not starvation, and no pool changes it.
    utilization: float
    #: Rollout-seconds spent over groups trained in the window (inf: none trained).
    rollout_s_per_group: float
    #: Mean rollout latency, seconds per step inside `backend.train`, groups per step.
    rollout_latency_s: float | None
    train_s_per_step: float
    groups_per_step: float
    #: Trained groups over rollouts that ended (stale, zero variance and errors lower it).
    yield_: float
    #: Little's law: workers that keep the trainer fed at this window's pace.
    workers_needed: float | None
    #: Rollouts that completed and were discarded as stale, over rollouts that ended.
    stale_done_fraction: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """One judgement of a window: what to run from now on, and why."""

    step: int
    #: "hold", "increase_workers", "decrease_workers", "lower_min_batch_size".
    action: str
    reason: str
    previous_workers: int
    num_rollout_workers: int
    min_batch_size: int
    #: True once the search has settled (a hold inside a closed bracket).
    settled: bool
    window: Window | None = None

    @property
    def changed(self) -> bool:
        return self.action != "hold"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(start: RunStatistics, end: RunStatistics, workers: int) -> Window:
    """The window between two snapshots of one run."""
    steps = max(1, end.steps - start.steps)
    wall = end.since_first_step_s - start.since_first_step_s
    train = end.train_s - start.train_s
    idle = end.idle_s - start.idle_s
    trained = end.trained - start.trained
    ended = (end.rollouts_started - end.rollouts_in_flight) - (
        start.rollouts_started - start.rollouts_in_flight
    )
    spent = end.rollout_s_spent - start.rollout_s_spent
    latency = end.rollout_latency_s
    if latency is None and ended > 0:
        latency = spent / ended
    train_per_step = train / steps
    groups_per_step = trained / steps
    yield_ = trained / ended if ended > 0 else 1.0
    # Rollouts that ran to the end and were then thrown away as stale: with eager admission
    # they are what workers beyond the pace's need produce (cancelled racers of an on-policy
    # run under staleness-aware admission are not counted here).
    stale_done = (end.stale - end.stale_cancelled) - (start.stale - start.stale_cancelled)
    needed = None
    if latency is not None and train_per_step > 0 and yield_ > 0:
        # Little's law: groups wanted per second times a rollout's latency, per useful one.
        needed = groups_per_step / train_per_step * latency / yield_
    return Window(
        start_step=start.steps,
        end_step=end.steps,
        wall_s=wall,
        utilization=max(0.0, 1 - idle / wall) if wall > 0 else 1.0,
        rollout_s_per_group=spent / trained if trained else math.inf,
        rollout_latency_s=latency,
        train_s_per_step=train_per_step,
        groups_per_step=groups_per_step,
        yield_=yield_,
        workers_needed=needed,
        stale_done_fraction=stale_done / ended if ended > 0 else 0.0,
    )
