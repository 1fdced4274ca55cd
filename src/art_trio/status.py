"""What a person watching a run sees: a live status line and a periodic `[status]` log line.

The reporter is one of the run's observers: it folds the run's events (events.py) into its
own tallies and smoothed numbers, and nothing else changes them. It only counts and formats;
it never awaits, so an event can never block the pipeline. The trainer's status stage decides
*when* to print. The constructor matches ART's `StatusReporter`; ART's `note_*` methods are
gone: feed it events instead (`reporter(event)`).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from art import TrajectoryGroup
from tqdm import tqdm

from .batching import is_zero_variance, reward_stats
from .events import (
    BatchTaken,
    EvalEnded,
    EvalStarted,
    GroupQueued,
    GroupReceived,
    Resized,
    RolloutEnded,
    RolloutStarted,
    RunEvent,
    ScenarioSettled,
    Stalled,
    StepTrained,
    TrainCallEnded,
)
from .messages import Fate


def reward_summary(batch: Sequence[TrajectoryGroup]) -> tuple[float | None, float, int]:
    """A trained batch's mean reward over its trajectories (None if it has none), the mean
    of its groups' reward standard deviations, and how many groups scored all alike: what
    `StepTrained` reports for the status line. One pass over each group's rewards."""
    flat = count = 0
    total = std_sum = 0.0
    for group in batch:
        n, group_total, std = reward_stats(group)
        # (Rewards all within the tolerance of the first have a tiny std: checked first.)
        flat += std < 1e-9 and is_zero_variance(group)
        count += n
        total += group_total
        std_sum += std
    return (total / count if count else None), (std_sum / len(batch) if batch else 0.0), flat


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _num(value: float | None, decimals: int, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.{decimals}f}"


class StatusReporter:
    """Counts of the pipeline's work and smoothed training numbers, rendered as text.

    `clock` defaults to `time.monotonic`; the trainer passes the event loop's clock so the
    log interval follows virtual time under trio's MockClock.
    """

    def __init__(
        self,
        *,
        get_scenario_offset: Callable[[], int],
        log_interval_seconds: float = 60.0,
        status_ewa_alpha: float = 0.2,
        total_scenarios: int | None = None,
        num_workers: int = 1,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
    ) -> None:
        if log_interval_seconds <= 0:
            raise ValueError("log_interval_seconds must be > 0")
        if not 0 < status_ewa_alpha <= 1:
            raise ValueError("status_ewa_alpha must be in (0, 1]")
        if total_scenarios is not None and total_scenarios < 0:
            raise ValueError("total_scenarios must be >= 0")
        if num_workers <= 0:
            raise ValueError("num_workers must be > 0")
        self.log_interval_seconds = log_interval_seconds
        self._get_scenario_offset = get_scenario_offset
        self._alpha = status_ewa_alpha
        self._total = total_scenarios
        self._workers = num_workers
        self._clock = clock
        self._stream = stream
        self.step: int | None = None
        self.rolling_out = 0
        self.queued = 0
        self.training = 0
        self.trained = 0
        self.stale = 0
        self.zero_variance = 0
        self.errored = 0
        self.reward_ewa: float | None = None
        self.step_seconds_ewa: float | None = None
        self.reward_std_ewa: float | None = None
        self.val_step: int | None = None
        self.val_reward: float | None = None
        self.val_running_step: int | None = None
        #: Stalls reported by the watchdog, and the last report's headline.
        self.stalls = 0
        self.last_stall: str | None = None
        self._bar: tqdm[None] | None = None
        #: The events the reporter follows, and how (see `Observers.begin_run`).
        self.routes: dict[type, Callable[[Any], None]] = {
            RolloutStarted: self._rollout_started,
            RolloutEnded: self._rollout_ended,
            GroupQueued: self._group_queued,
            GroupReceived: self._group_received,
            ScenarioSettled: self._settled,
            BatchTaken: self._batch_taken,
            TrainCallEnded: self._train_ended,
            StepTrained: self._step_trained,
            EvalStarted: self._eval_started,
            EvalEnded: self._eval_ended,
            Resized: self._resized,
            Stalled: self._stalled,
        }
        self._started = False
        self._last_log = 0.0
        self._last_refresh = 0.0

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, *, initial_step: int | None = None) -> None:
        if self._started:
            return
        self._started = True
        if initial_step is not None:
            self.step = initial_step
        self._last_log = self._clock() - self.log_interval_seconds
        out = self._out()
        if out.isatty():
            # A one-line bar that only shows its description: the condensed status.
            self._bar = tqdm(bar_format="{desc}", dynamic_ncols=True, leave=False, file=out)
            self._refresh(force=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._started = False

    def flush(self) -> None:
        self.log_if_due(force=True)

    def seconds_until_log(self) -> float:
        """How long until the next periodic `[status]` line is due."""
        return max(0.0, self._last_log + self.log_interval_seconds - self._clock())

    def log_if_due(self, *, force: bool = False) -> None:
        if not self._started:
            return
        now = self._clock()
        if not force and now - self._last_log < self.log_interval_seconds:
            return
        self._last_log = now
        self._write(self.full_line())

    # -- events --------------------------------------------------------------------------

    def __call__(self, event: RunEvent) -> None:
        """Fold one of the run's events (the run registers the reporter as an observer)."""
        fold = self.routes.get(type(event))
        if fold is not None:
            fold(event)

    def _rollout_started(self, event: RolloutStarted) -> None:
        self.rolling_out += 1
        if self._bar is not None:
            self._refresh()

    def _rollout_ended(self, event: RolloutEnded) -> None:
        self.rolling_out = max(0, self.rolling_out - 1)
        if self._bar is not None:
            self._refresh()

    def _group_queued(self, event: GroupQueued) -> None:
        self.queued += 1
        if self._bar is not None:
            self._refresh()

    def _group_received(self, event: GroupReceived) -> None:
        self.queued = max(0, self.queued - 1)
        if self._bar is not None:
            self._refresh()

    def _settled(self, event: ScenarioSettled) -> None:
        fate = event.fate
        if fate is Fate.STALE or fate is Fate.CANCELLED_STALE:
            self.stale += 1
        elif fate is Fate.ZERO_VARIANCE:
            self.zero_variance += 1
        elif fate is Fate.ERRORED:
            self.errored += 1
        else:
            return
        if self._bar is not None:
            self._refresh()

    def _batch_taken(self, event: BatchTaken) -> None:
        self.training = event.batch_size
        self._refresh()

    def _train_ended(self, event: TrainCallEnded) -> None:
        self.training = 0
        self._refresh()

    def _step_trained(self, event: StepTrained) -> None:
        flat = event.zero_variance_groups
        self.step = event.step
        self.trained += event.batch_size - flat
        self.zero_variance += flat
        if event.reward_mean is not None:
            self.reward_ewa = self._ewa(self.reward_ewa, event.reward_mean)
        self.step_seconds_ewa = self._ewa(self.step_seconds_ewa, event.wall_s)
        self.reward_std_ewa = self._ewa(self.reward_std_ewa, event.reward_std_mean)
        self._refresh(force=True)

    def _eval_started(self, event: EvalStarted) -> None:
        self.val_running_step = event.step
        self._refresh(force=True)

    def _eval_ended(self, event: EvalEnded) -> None:
        self.val_step, self.val_reward = event.step, event.reward
        if self.val_running_step == event.step:
            self.val_running_step = None
        self._refresh(force=True)

    def _resized(self, event: Resized) -> None:
        """The run was resized: the status shows the live worker count."""
        self._workers = event.num_rollout_workers
        self._refresh()

    def _stalled(self, event: Stalled) -> None:
        """The watchdog reported a stall: the lines show how many, and the last one."""
        self.stalls += event.report.repeat == 1
        self.last_stall = event.report.headline()
        self._refresh(force=True)

    # -- rendering -----------------------------------------------------------------------

    @property
    def remaining(self) -> int | None:
        if self._total is None:
            return None
        return max(self._total - self._get_scenario_offset(), 0)

    @property
    def discarded(self) -> int:
        return self.zero_variance + self.stale + self.errored

    def full_line(self) -> str:
        """The periodic log line, every field spelled out."""
        scenarios = [f"trained={self.trained}"]
        if self.remaining is not None:
            scenarios.append(f"remaining={self.remaining}")
        scenarios += [
            f"queued={self.queued}",
            f"training={self.training}",
            f"discarded[total={self.discarded} 0_var={self.zero_variance} "
            f"stale={self.stale} errored={self.errored}]",
            f"rollouts={self.rolling_out}/{self._workers}",
        ]
        train = [
            f"step={_count(self.step)}",
            f"reward={_num(self.reward_ewa, 3)}",
            f"step_seconds={_num(self.step_seconds_ewa, 2)}",
            f"avg_std={_num(self.reward_std_ewa, 3)}",
        ]
        val = [
            f"reward={_num(self.val_reward, 3)}",
            f"active={'yes' if self.val_running_step is not None else 'no'}",
        ]
        if self.val_step is not None:
            val.append(f"step={self.val_step}")
        if self.val_running_step is not None:
            val.append(f"active_step={self.val_running_step}")
        stalls = "" if not self.stalls else f" stalls[count={self.stalls} last={self.last_stall}]"
        return (
            f"[status] scenarios[{' '.join(scenarios)}] train[{' '.join(train)}] "
            f"val[{' '.join(val)}]{stalls}"
        )

    def condensed_line(self, width: int | None = None) -> str:
        """The live line, dropping the least useful fields until it fits `width` columns."""
        width = width or shutil.get_terminal_size(fallback=(120, 20)).columns
        optional = ["sd", "act", "r_left"]  # dropped in this order when too wide
        while True:
            scen = [f"tr={self.trained}"]
            if self.remaining is not None and "r_left" in optional:
                scen.append(f"r={self.remaining}")
            scen += [f"q={self.queued}", f"b={self.training}", f"d={self.discarded}"]
            train = [
                f"s={'na' if self.step is None else self.step}",
                f"r={_num(self.reward_ewa, 2, missing='na')}",
                f"dt={_num(self.step_seconds_ewa, 1, missing='na')}",
            ]
            if "sd" in optional:
                train.append(f"sd={_num(self.reward_std_ewa, 2, missing='na')}")
            val = [f"r={_num(self.val_reward, 2, missing='na')}"]
            if "act" in optional:
                val.append(f"act={'y' if self.val_running_step is not None else 'n'}")
            line = f"scenarios[{' '.join(scen)}] train[{' '.join(train)}] val[{' '.join(val)}]"
            if self.stalls:
                line += f" STALLED x{self.stalls}"
            if len(line) <= width or not optional:
                return line
            optional.pop(0)

    def write_line(self, line: str) -> None:
        """Print one line of its own beside the status line (the autotuner's decisions)."""
        self._write(line)

    def _ewa(self, previous: float | None, value: float) -> float:
        return value if previous is None else self._alpha * value + (1 - self._alpha) * previous

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._out())
        else:
            print(line, file=self._out(), flush=True)

    def _refresh(self, *, force: bool = False) -> None:
        if self._bar is None:
            return
        now = self._clock()
        if not force and now - self._last_refresh < 0.25:
            return
        self._last_refresh = now
        self._bar.set_description_str(self.condensed_line())


__all__ = ["StatusReporter", "reward_summary"]
