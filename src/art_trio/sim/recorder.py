"""What the doubles saw during one run, in the running event loop's clock (real or virtual).

The backend double records every train step (timing, batch, the batch's staleness), the
rollout double every rollout's start, end and outcome; :mod:`art_trio.sim.measures` turns a
:class:`Recorder` into a report.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import art

from art_trio.testing.doubles import group_initial_version

__all__ = [
    "Outcome",
    "Recorder",
    "RssSample",
    "StepRecord",
    "current_rss_bytes",
    "peak_rss_bytes",
]

def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (stdlib ``getrusage``; no psutil needed)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int | None:
    """Current resident set size, where ``/proc`` has it (Linux); else ``None``."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


Outcome = Literal["ok", "failed", "zero_variance", "cancelled"]


@dataclass(frozen=True)
class StepRecord:
    """One ``backend.train`` call as the synthetic backend saw it."""

    #: Policy version this step produced (the ``TrainResult.step`` it returned).
    step: int
    #: Policy version the step trained from (``step - 1`` unless the backend was resumed).
    base_version: int
    start: float
    end: float
    n_groups: int
    #: Scenario ids of the batch's groups (empty when the recorder is not detailed).
    scenario_ids: tuple[int, ...] = ()
    #: Each group's ``initial_policy_version`` (min over its trajectories, as ART reads it).
    initial_versions: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class RssSample:
    """Memory at a point of the run."""

    groups_trained: int
    peak_bytes: int
    current_bytes: int | None


class Recorder:
    """Everything the doubles saw, in the clock of the running event loop (real or virtual).

    With ``detailed=False`` only counters, per-step timings and the staleness histogram are
    kept, so the recorder's memory does not grow per rollout (the memory workload).
    """

    def __init__(self, *, detailed: bool = True, rss_checkpoints: Iterable[int] = ()) -> None:
        self.detailed = detailed
        self.steps: list[StepRecord] = []
        self.rollout_start: dict[int, float] = {}
        self.rollout_end: dict[int, float] = {}
        self.rollout_outcome: dict[int, Outcome] = {}
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.zero_variance = 0
        self.groups_trained = 0
        #: Trained groups by staleness (base_version - initial_policy_version).
        self.staleness: Counter[int] = Counter()
        self.evals: list[tuple[int, float, float]] = []
        self.train_called_at: float | None = None
        self.train_returned_at: float | None = None
        #: Process CPU seconds spent from the train() call to its return (set by the runner;
        #: unlike wall time, barely moved by other load on the machine).
        self.train_cpu_s: float | None = None
        self.rss_samples: list[RssSample] = []
        self._rss_pending = sorted(set(rss_checkpoints))

    def rollout_started(self, scenario_id: int, now: float) -> None:
        """A rollout for ``scenario_id`` began (before its latency sleep)."""
        self.started += 1
        if self.detailed:
            self.rollout_start[scenario_id] = now

    def rollout_finished(self, scenario_id: int, now: float, outcome: Outcome) -> None:
        """The rollout's latency elapsed and it produced a group (or failed)."""
        self.completed += 1
        if outcome == "failed":
            self.failed += 1
        elif outcome == "zero_variance":
            self.zero_variance += 1
        if self.detailed:
            self.rollout_end[scenario_id] = now
            self.rollout_outcome[scenario_id] = outcome

    def rollout_cancelled(self, scenario_id: int, now: float) -> None:
        """The rollout was cancelled (or otherwise interrupted) before its latency elapsed."""
        self.cancelled += 1
        if self.detailed:
            self.rollout_end[scenario_id] = now
            self.rollout_outcome[scenario_id] = "cancelled"

    def record_step(
        self,
        *,
        step: int,
        base_version: int,
        start: float,
        end: float,
        groups: Sequence[art.TrajectoryGroup],
    ) -> None:
        """A train step finished; note its timing, batch and the batch's staleness."""
        versions = [group_initial_version(g) for g in groups]
        for version in versions:
            if version is not None:
                self.staleness[base_version - version] += 1
        ids: tuple[int, ...] = ()
        if self.detailed:
            ids = tuple(_group_scenario_id(g) for g in groups)
        self.steps.append(
            StepRecord(
                step=step,
                base_version=base_version,
                start=start,
                end=end,
                n_groups=len(groups),
                scenario_ids=ids,
                initial_versions=tuple(versions) if self.detailed else (),
            )
        )
        self.groups_trained += len(groups)
        while self._rss_pending and self.groups_trained >= self._rss_pending[0]:
            self._rss_pending.pop(0)
            self.sample_rss()

    def sample_rss(self) -> RssSample:
        """Record the process's peak and current RSS now."""
        sample = RssSample(self.groups_trained, peak_rss_bytes(), current_rss_bytes())
        self.rss_samples.append(sample)
        return sample


def _group_scenario_id(group: art.TrajectoryGroup) -> int:
    value = group.metadata.get("scenario_id", -1)
    return int(value) if isinstance(value, (int, float, str)) else -1

