"""What a person watching a run sees: a live status line and a periodic `[status]` log line.

The reporter is one of the run's observers: its counts are the run's counters (a
`CounterFold`, the run's own or, standing alone, one it feeds itself), and it folds only what
they do not keep: smoothed numbers, the batch in training, the last eval and stall. It only
formats; it never awaits, so an event can never block the pipeline. The trainer's status
stage decides *when* to print. The constructor matches ART's `StatusReporter`; ART's `note_*`
methods are gone: feed it events instead (`reporter(event)`).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from art import TrajectoryGroup
from tqdm import tqdm

from ..messages.events import (
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
from ..policy.batching import is_zero_variance, reward_stats
from .fates import CounterFold, RunCounters


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


#: Printed once per run, the first time skipped identical-reward groups outnumber the trained.
ZERO_VARIANCE_NOTE = (
    "[status] note: a group whose rollouts all got the same reward has no learning signal "
    "(every advantage is 0), so it is skipped, not trained. Many such skips are normal when the "
    "task is easy for the policy or it has converged; for more signal use larger groups or a "
    "finer-grained reward."
)


def _num(value: float | None, decimals: int, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.{decimals}f}"


class StatusReporter:
    """Counts of the pipeline's work and smoothed training numbers, rendered as text.

    `clock` defaults to `time.monotonic`; the trainer passes the event loop's clock so the
    log interval follows virtual time under trio's MockClock. `counters`: the run's
    `CounterFold`, which the run feeds the events first; None, the reporter folds its own.
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
        counters: CounterFold | None = None,
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
        #: Folded by the run (its `CounterFold` hears each event first), or here if alone.
        self._own_fold = counters is None
        self._fold = counters if counters is not None else CounterFold()
        self.step: int | None = None
        self.training = 0
        self.reward_ewa: float | None = None
        self.step_seconds_ewa: float | None = None
        self.reward_std_ewa: float | None = None
        self.val_step: int | None = None
        self.val_reward: float | None = None
        self.val_running_step: int | None = None
        #: The last stall report's headline.
        self.last_stall: str | None = None
        self._bar: tqdm[None] | None = None
        #: The events the reporter follows, and how (see `Observers.begin_run`).
        self.routes: dict[type, Callable[[Any], None]] = {
            **dict.fromkeys(
                (RolloutStarted, RolloutEnded, GroupQueued, GroupReceived, ScenarioSettled),
                self._counted,
            ),
            **dict.fromkeys((BatchTaken, TrainCallEnded), self._training),
            StepTrained: self._step_trained,
            EvalStarted: self._eval_started,
            EvalEnded: self._eval_ended,
            Resized: self._resized,
            Stalled: self._stalled,
        }
        #: The `[status]` line's parts in order; `add_part` appends one.
        self.parts: list[Callable[[], str | None]] = [
            self._step_part,
            self._groups_part,
            self._skipped_part,
            self._rollouts_part,
            self._train_part,
            self._val_part,
            self._stalls_part,
        ]
        self._noted_zero_variance = False
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
        self._note_if_skips_dominate()

    # -- events --------------------------------------------------------------------------

    def __call__(self, event: RunEvent) -> None:
        """Fold one of the run's events (the run registers the reporter as an observer)."""
        if self._own_fold:
            self._fold(event)
        fold = self.routes.get(type(event))
        if fold is not None:
            fold(event)

    def _counted(self, event: RunEvent) -> None:
        """The counters moved: the live line follows (at most every 0.25 s)."""
        if self._bar is not None:
            self._refresh()

    def _training(self, event: BatchTaken | TrainCallEnded) -> None:
        """A batch went into training, or its `backend.train` call ended."""
        self.training = event.batch_size if isinstance(event, BatchTaken) else 0
        self._refresh()

    def _step_trained(self, event: StepTrained) -> None:
        self.step = event.step
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
        self.last_stall = event.report.headline()
        self._refresh(force=True)

    # -- rendering -----------------------------------------------------------------------

    @property
    def remaining(self) -> int | None:
        if self._total is None:
            return None
        return max(self._total - self._get_scenario_offset(), 0)

    @property
    def counters(self) -> RunCounters:
        """The counts the lines show: the run's counters (read them; never write)."""
        return self._fold.counters

    @property
    def rolling_out(self) -> int:
        return self.counters.rollouts_started - self.counters.rollouts_ended

    @property
    def queued(self) -> int:
        return self.counters.delivered - self.counters.received

    @property
    def trained(self) -> int:
        """Trained groups with a learning signal (a batch's identical-reward groups are
        shown as skipped)."""
        return self.counters.trained - self.counters.trained_flat

    @property
    def zero_variance(self) -> int:
        return self.counters.zero_variance + self.counters.trained_flat

    @property
    def discarded(self) -> int:
        return self.zero_variance + self.counters.stale + self.counters.errored

    def full_line(self) -> str:
        """The periodic log line: the parts, in plain words, separated by `` | ``."""
        parts = [text for part in self.parts if (text := part())]
        return "[status] " + " | ".join(parts)

    def add_part(self, part: Callable[[], str | None]) -> None:
        """Append a part to the `[status]` line: `part()` returns its text, or None to leave
        it out of this line."""
        self.parts.append(part)

    def _step_part(self) -> str:
        return f"step {'n/a' if self.step is None else self.step}"

    def _groups_part(self) -> str:
        # A scenario's rollouts form one group, and the trainer trains or skips whole groups.
        words = [f"trained {self.trained} groups", f"{self.queued} queued",
                 f"{self.training} in training"]
        if self.remaining is not None:
            words.append(f"{self.remaining} scenarios left")
        return ", ".join(words)

    def _skipped_part(self) -> str:
        reasons = [
            (self.zero_variance, "with identical rewards (no learning signal)"),
            (self.counters.stale, "too stale (beyond max_steps_off_policy)"),
            (self.counters.errored, "whose rollout failed"),
        ]
        said = [f"{n} {why}" for n, why in reasons if n]
        return "skipped " + (f"{self.discarded} groups: " + ", ".join(said) if said else "none")

    def _rollouts_part(self) -> str:
        return f"rollouts: {self.rolling_out} of {self._workers} workers busy"

    def _train_part(self) -> str:
        return (
            f"train: reward {_num(self.reward_ewa, 3)}, {_num(self.step_seconds_ewa, 2)} s/step, "
            f"reward std {_num(self.reward_std_ewa, 3)} (smoothed)"
        )

    def _stalls_part(self) -> str | None:
        stalls = self.counters.stalls
        return f"STALLED {stalls} times (last: {self.last_stall})" if stalls else None

    def _val_part(self) -> str:
        text = f"val: reward {_num(self.val_reward, 3)}"
        if self.val_step is not None:
            text += f" at step {self.val_step}"
        if self.val_running_step is not None:
            text += f", evaluating step {self.val_running_step}"
        return text

    def _note_if_skips_dominate(self) -> None:
        """Say once why many skipped groups are not a fault, when they first outnumber the
        trained ones (a newcomer sees '342 skipped, 120 trained' and suspects a bug)."""
        if self._noted_zero_variance or self.zero_variance < max(10, self.trained):
            return
        self._noted_zero_variance = True
        self._write(ZERO_VARIANCE_NOTE)

    def condensed_line(self, width: int | None = None) -> str:
        """The live line, dropping the least useful fields until it fits `width` columns."""
        width = width or shutil.get_terminal_size(fallback=(120, 20)).columns
        val = f"val {_num(self.val_reward, 2, missing='-')}"
        # The fields dropped when too wide, in this order (None: not shown anyway).
        optional = {
            "std": f"std {_num(self.reward_std_ewa, 2, missing='-')}",
            "eval": None if self.val_running_step is None else f"{val} (evaluating)",
            "left": None if self.remaining is None else f"{self.remaining} left",
            "training": f"{self.training} training",
            "queued": f"{self.queued} queued",
        }
        while True:
            words = [
                f"step {'-' if self.step is None else self.step}", f"{self.trained} trained",
                optional.get("left"), optional.get("queued"), optional.get("training"),
                f"{self.discarded} skipped", f"reward {_num(self.reward_ewa, 2, missing='-')}",
                f"{_num(self.step_seconds_ewa, 1, missing='-')} s/step", optional.get("std"),
                optional.get("eval") or val,
                f"STALLED x{self.counters.stalls}" if self.counters.stalls else None,
            ]
            line = " · ".join(word for word in words if word)
            if len(line) <= width or not optional:
                return line
            del optional[next(iter(optional))]

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
