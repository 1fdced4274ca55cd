"""Every reported measure of a run, defined once, from a :class:`Recorder`'s records.

The benchmark's :class:`RunReport` (:func:`measure`) and the simulator's ``SimReport`` both
take their numbers from here. Definitions:

- **train window**: first train start to last train end; **trainer utilization**: time inside
  ``backend.train`` over the window (NaN when the window is empty).
- **rollout-seconds**: a rollout's run time from its start until it completed, failed or was
  cancelled, or (never seen to end) until ``train()`` returned. **Rollout-seconds per trained
  group**: every rollout's seconds over trained groups (what inference costs per group).
- **eligible rollouts**: those started before the last train step began (only those could
  have been trained).
- **left at the end**: never trained rollouts the run's end left behind (running, queued or
  ready, which no batch could take any more). From the records alone: not completed before
  the last train step began. The simulator knows exactly: unresolved in art_trio's ledger.
- **wasted rollouts**: completed with a trainable group, never trained, not left at the end
  (stale groups); **waste**: wasted rollouts over eligible rollouts. Failed and zero-variance
  rollouts are not waste of the scheduler's making (they stay in the denominator).
- **cancelled share**: eligible rollouts cancelled before completing, over eligible ones.
- **wasted rollout-seconds**: seconds of never-trained rollouts that are not left at the end
  and not failed or zero-variance (stale ones and the part-run of cancelled ones).
- **wasted work**: seconds of never-trained eligible rollouts that are not failed or
  zero-variance, the end-of-run tail included, over all eligible rollout-seconds.
- **staleness**: trained groups by ``base_version - initial_policy_version`` (0 = on-policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from art_trio.sim.recorder import Recorder, StepRecord, peak_rss_bytes

__all__ = [
    "RolloutTally",
    "RunReport",
    "TrainWindow",
    "format_staleness",
    "mean_staleness",
    "measure",
    "ratio",
    "tally_rollouts",
    "train_window",
]

_MB = 1024 * 1024


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when the denominator is 0."""
    return numerator / denominator if denominator else math.nan


@dataclass(frozen=True)
class TrainWindow:
    """When the trainer trained: first start, last start, last end, and time inside train."""

    first_start: float
    last_start: float
    last_end: float
    busy: float
    steps: int
    groups: int

    @property
    def seconds(self) -> float:
        return self.last_end - self.first_start if self.steps else 0.0

    @property
    def utilization(self) -> float:
        """Time inside ``backend.train`` over the window; NaN for an empty window."""
        return self.busy / self.seconds if self.seconds > 0 else math.nan


def train_window(steps: Sequence[StepRecord]) -> TrainWindow:
    """The train window of a run's steps (NaN times when there are none)."""
    if not steps:
        return TrainWindow(math.nan, math.nan, math.nan, 0.0, 0, 0)
    return TrainWindow(
        first_start=min(s.start for s in steps),
        last_start=max(s.start for s in steps),
        last_end=max(s.end for s in steps),
        busy=sum(s.end - s.start for s in steps),
        steps=len(steps),
        groups=sum(s.n_groups for s in steps),
    )


def mean_staleness(hist: Mapping[int, int]) -> float:
    """Mean staleness of trained groups (NaN if none)."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else math.nan


def format_staleness(hist: Mapping[int, int]) -> str:
    """``0:11% 1:89%``: share of trained groups at each staleness (``-`` if none)."""
    n = sum(hist.values())
    if not n:
        return "-"
    parts = []
    for k, v in sorted(hist.items()):
        share = 100 * v / n
        parts.append(f"{k}:{share:.0f}%" if share >= 1 else f"{k}:<1%")
    return " ".join(parts)


@dataclass
class RolloutTally:
    """Every recorded rollout, classified once (see the module's definitions)."""

    started: int = 0
    eligible: int = 0
    cancelled_eligible: int = 0
    wasted: int = 0
    left_at_end: int = 0
    #: Eligible rollouts left at the end that had completed with a trainable group.
    left_at_end_completed: int = 0
    paid_s: float = 0.0
    eligible_s: float = 0.0
    wasted_s: float = 0.0
    left_at_end_s: float = 0.0
    #: Wasted work's numerator.
    untrained_eligible_s: float = 0.0

    @property
    def waste(self) -> float:
        return ratio(self.wasted, self.eligible)

    @property
    def waste_incl_tail(self) -> float:
        return ratio(self.wasted + self.left_at_end_completed, self.eligible)

    @property
    def cancelled_share(self) -> float:
        return ratio(self.cancelled_eligible, self.eligible)

    @property
    def wasted_work(self) -> float:
        return ratio(self.untrained_eligible_s, self.eligible_s)

    def add(
        self,
        seconds: float,
        *,
        eligible: bool,
        trained: bool,
        outcome: str | None,
        ended: bool,
        left: bool,
    ) -> None:
        """Count one rollout (``ended``: completed, failed or cancelled before the end)."""
        self.started += 1
        self.paid_s += seconds
        trainable = outcome not in ("failed", "zero_variance")
        if eligible:
            self.eligible += 1
            self.eligible_s += seconds
            self.cancelled_eligible += outcome == "cancelled"
            if not trained and trainable:
                self.untrained_eligible_s += seconds
        if trained:
            return
        if left:
            self.left_at_end += 1
            self.left_at_end_s += seconds
            self.left_at_end_completed += eligible and ended and outcome == "ok"
        elif trainable:
            self.wasted_s += seconds
            self.wasted += ended and outcome == "ok"


def tally_rollouts(
    records: Recorder,
    window: TrainWindow,
    *,
    left_at_end: Callable[[int], bool] | None = None,
) -> RolloutTally:
    """Classify every rollout of a detailed record.

    ``left_at_end(scenario_id)`` says which never-trained rollouts the run's end left behind;
    by default, those that had not completed before the last train step began.
    """
    trained = {sid for s in records.steps for sid in s.scenario_ids}
    # Rollouts never seen to end ran at least until train() returned.
    open_end = records.train_returned_at
    if open_end is None:
        open_end = window.last_end
    last_start = window.last_start
    tally = RolloutTally()
    for sid, started_at in records.rollout_start.items():
        ended_at = records.rollout_end.get(sid)
        end = open_end if ended_at is None else ended_at
        if left_at_end is not None:
            left = left_at_end(sid)
        else:
            left = ended_at is None or not ended_at < last_start
        tally.add(
            max(0.0, end - started_at),
            eligible=started_at < last_start,
            trained=sid in trained,
            outcome=records.rollout_outcome.get(sid),
            ended=ended_at is not None,
            left=left,
        )
    return tally


# --------------------------------------------------------------------------------------------
# The benchmark's report
# --------------------------------------------------------------------------------------------


@dataclass
class RunReport:
    """What one trainer run did with one workload (definitions in the module docstring)."""

    steps: int
    groups: int
    #: First train start to last train end.
    window_s: float
    steps_per_s: float
    groups_per_s: float
    #: Share of the window the trainer spent inside ``backend.train``.
    utilization: float
    #: Wasted rollouts over eligible rollouts. ``None`` without detailed records. (On ART
    #: 0.5.18 it lands within a few points of the "Scheduler performance" issue's numbers,
    #: e.g. 0.83 on-policy, 0.51 tight-off1, 0.001 defaults.)
    waste: float | None
    #: As ``waste``, also counting the rollouts left at the end that had completed with a
    #: trainable group (which no trainer could still put in a batch); 2-8 points higher.
    waste_incl_tail: float | None
    wasted: int | None
    started_before_last_step: int | None
    #: Of the eligible rollouts, the share cancelled before they completed (a trainer
    #: dropping rollouts no batch can use any more).
    cancelled_share: float | None
    #: Rollout-seconds of eligible rollouts never trained (stale, left over, cancelled
    #: part-way, or run out at the end) over all their rollout-seconds.
    wasted_work: float | None
    #: Every rollout-second paid per trained group: what inference costs per group.
    rollout_s_per_group: float | None
    #: Trained groups by staleness ``base_version - initial_policy_version``.
    staleness: dict[int, int]
    #: Last train end to ``trainer.train()`` returning.
    return_latency_s: float | None
    #: ``train()`` call to return.
    wall_s: float | None
    #: Process CPU seconds from ``train()`` call to return, and per trained group.
    cpu_s: float | None
    cpu_us_per_group: float | None
    peak_rss_mb: float
    #: ``(groups trained, peak RSS MB)`` at the workload's checkpoints and at the end.
    rss_mb: list[tuple[int, float]]
    rollouts_started: int
    rollouts_completed: int
    rollouts_cancelled: int
    rollouts_failed: int
    zero_variance: int
    labels: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        data["rss_mb"] = [list(x) for x in self.rss_mb]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        data = dict(data)
        data["staleness"] = {int(k): int(v) for k, v in data["staleness"].items()}
        data["rss_mb"] = [(int(g), float(m)) for g, m in data["rss_mb"]]
        data.setdefault("rollout_s_per_group", None)  # reports written before it existed
        return cls(**data)


def _waste_fields(records: Recorder, window: TrainWindow) -> dict[str, Any]:
    """The report's rollout-accounting fields (None without detailed records or steps)."""
    if not (records.detailed and window.steps):
        return dict.fromkeys(
            (
                "waste",
                "waste_incl_tail",
                "wasted",
                "started_before_last_step",
                "cancelled_share",
                "wasted_work",
                "rollout_s_per_group",
            )
        )
    tally = tally_rollouts(records, window)
    return {
        "waste": tally.waste,
        "waste_incl_tail": tally.waste_incl_tail,
        "wasted": tally.wasted,
        "started_before_last_step": tally.eligible,
        "cancelled_share": tally.cancelled_share,
        "wasted_work": tally.wasted_work,
        "rollout_s_per_group": ratio(tally.paid_s, window.groups),
    }


def _timing_fields(records: Recorder, window: TrainWindow) -> dict[str, Any]:
    """Return latency, wall time and CPU per group."""
    returned, called, cpu = records.train_returned_at, records.train_called_at, records.train_cpu_s
    return {
        "return_latency_s": (
            returned - window.last_end if returned is not None and window.steps else None
        ),
        "wall_s": returned - called if returned is not None and called is not None else None,
        "cpu_s": cpu,
        "cpu_us_per_group": (
            cpu / window.groups * 1e6 if cpu is not None and window.groups else None
        ),
    }


def _memory_fields(records: Recorder) -> dict[str, Any]:
    """Peak RSS now, and at the workload's checkpoints and the end."""
    peak = peak_rss_bytes()
    rss = [(s.groups_trained, s.peak_bytes / _MB) for s in records.rss_samples]
    if not rss or rss[-1][0] != records.groups_trained:
        rss.append((records.groups_trained, peak / _MB))
    return {"peak_rss_mb": peak / _MB, "rss_mb": rss}


def measure(records: Recorder) -> RunReport:
    """Compute a :class:`RunReport` from a finished run's records.

    Rates (steps/s, groups/s) and utilization are over the train window; see the module for
    the other definitions. Peak RSS is this process's ``getrusage`` peak, sampled now.
    """
    window = train_window(records.steps)
    seconds = window.seconds
    return RunReport(
        steps=window.steps,
        groups=window.groups,
        window_s=seconds,
        # Zero-length window (instant train in virtual time, or no steps): rates undefined.
        steps_per_s=window.steps / seconds if seconds > 0 else math.nan,
        groups_per_s=window.groups / seconds if seconds > 0 else math.nan,
        utilization=window.utilization,
        staleness=dict(sorted(records.staleness.items())),
        rollouts_started=records.started,
        rollouts_completed=records.completed,
        rollouts_cancelled=records.cancelled,
        rollouts_failed=records.failed,
        zero_variance=records.zero_variance,
        **_waste_fields(records, window),
        **_timing_fields(records, window),
        **_memory_fields(records),
    )
