"""Plan a run before paying for it: art_trio's real PipelineTrainer in virtual time.

The trainer reads time only from the running event loop, so under trio's
``MockClock(autojump_threshold=0)`` every sleep of the synthetic backend and rollouts
(:mod:`art_trio.sim.doubles`) completes the instant nothing else can run: hours of a run
take seconds. Nothing of the scheduler is modelled; the very code a real run executes makes
every decision (admission, batching, staleness, cancellation).

What a user may rely on:

- :func:`simulate` runs one :class:`SimSpec` and returns a :class:`SimReport`; with
  ``real_time=True`` it runs the same code against the wall clock (for checking the
  simulator; the sleeps then really take their time).
- :func:`sweep` runs the cartesian product of a grid of trainer settings and names the
  cheapest setting that keeps the trainer busy (:func:`cheapest`).
- The same spec and seed give the same report (latencies are drawn per scenario index).
- Metric definitions are in :mod:`art_trio.sim.measures` and :class:`SimReport`'s field
  comments.
- ``SimSpec.inference_capacity`` models an inference server of limited capacity (rollouts
  slow down when more are in flight), ``SimSpec.latency_shift`` a latency that changes at a
  given step (:mod:`art_trio.sim.inference`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import itertools
import math
import os
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

# Before ART is imported (art_trio.testing sets it too): keep litellm off the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import anyio  # noqa: E402
import trio  # noqa: E402
import trio.testing  # noqa: E402

from art_trio import (  # noqa: E402
    BatchTaken,
    Fate,
    GroupQueued,
    PipelineTrainer,
    RunCounters,
    RunEvent,
    ScenarioSettled,
    trainable_model,
    trio_native,
)
from art_trio.sim.doubles import SyntheticBackend, eval_double, make_rollout_fn  # noqa: E402
from art_trio.sim.inference import LatencyShift  # noqa: E402
from art_trio.sim.measures import (  # noqa: E402
    RolloutTally,
    mean_staleness,
    ratio,
    tally_rollouts,
    train_window,
)
from art_trio.sim.recorder import Recorder  # noqa: E402
from art_trio.sim.workloads import Workload, scenarios  # noqa: E402
from art_trio.testing.distributions import (  # noqa: E402
    LatencyDist,
    describe_distribution,
)
from art_trio.timeline.recorder import record_timeline  # noqa: E402

__all__ = [
    "DEFAULT_TARGET",
    "RESIZE_PARAMETERS",
    "SIM_TRAINER_DEFAULTS",
    "SimReport",
    "SimSpec",
    "SweepResult",
    "check_settings",
    "cheapest",
    "combinations",
    "parse_value",
    "simulate",
    "sweep",
    "trainer_parameter_names",
]

#: Trainer utilization a sweep's "cheapest" setting must reach unless told otherwise.
DEFAULT_TARGET = 0.95

#: Trainer settings the simulator uses unless the spec sets them. The status line stays
#: quiet (one `[status]` line per ~30,000 simulated years), nothing is resumed from a
#: previous simulation, and the resume record is not fsynced (costs wall time only).
SIM_TRAINER_DEFAULTS: Mapping[str, Any] = {
    "log_interval_seconds": 1e12,
    "resume": False,
    "fsync_state": False,
}

#: Virtual seconds after which a simulation is cut short and reported as stalled: a pipeline
#: that stops making progress would otherwise jump from one far-off timer to the next forever.
DEFAULT_TIME_LIMIT_S = 1e9

#: What `SimSpec.resizes` may change: the keyword arguments of `PipelineTrainer.resize` that
#: size the run.
RESIZE_PARAMETERS = ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize")

# PipelineTrainer parameters the simulator provides itself; everything else may be set.
_PROVIDED = frozenset({"self", "model", "backend", "rollout_fn", "scenarios", "config", "eval_fn"})


def trainer_parameter_names() -> tuple[str, ...]:
    """Keyword arguments of `PipelineTrainer` a spec (or a sweep) may set."""
    params = inspect.signature(PipelineTrainer.__init__).parameters
    return tuple(name for name in params if name not in _PROVIDED)


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimSpec:
    """One simulated run: how long things take, how often they fail, and the trainer settings.

    ``trainer`` holds `PipelineTrainer` keyword arguments (``num_rollout_workers``,
    ``min_batch_size``, ``max_steps_off_policy``, ``admission``, ...); unset ones take the
    trainer's defaults, except :data:`SIM_TRAINER_DEFAULTS`. The run length is ``steps``
    (the trainer's ``max_steps``) and/or ``scenarios`` (size of the scenario source).
    """

    rollout_latency: LatencyDist
    train_time: LatencyDist
    #: Duration of one eval; ``None``: no ``eval_fn`` (evals never block training anyway).
    eval_time: LatencyDist | None = None
    #: Probability that a rollout's group has zero reward variance (the trainer drops it).
    zero_variance_prob: float = 0.0
    #: Probability that a rollout raises (the trainer counts it as errored).
    failure_prob: float = 0.0
    steps: int | None = 100
    scenarios: int | None = None
    seed: int = 0
    trainer: Mapping[str, Any] = field(default_factory=dict)
    #: Rollouts the inference server serves at full speed; beyond it, the rollouts in flight
    #: share its throughput (processor sharing: with n > capacity in flight, each progresses
    #: at capacity / n of full speed; see :mod:`art_trio.sim.inference`). None: no contention.
    inference_capacity: int | None = None
    #: Rollouts started after ``after_steps`` train steps take ``factor`` x their draw.
    latency_shift: LatencyShift | None = None
    #: CPU seconds the trainer's process spends per rollout, on one core (FIFO; see
    #: :mod:`art_trio.sim.host`). 0: CPU is free, as virtual time makes it otherwise.
    rollout_cpu_s: float = 0.0
    #: Live ``trainer.resize`` calls, each ``(seconds after train() was called, keyword
    #: arguments of PipelineTrainer.resize)``: what an operator or an outside tuner changing
    #: the run's sizes mid-run does to it (one due after the run ended is never made).
    resizes: tuple[tuple[float, Mapping[str, int]], ...] = ()

    def __post_init__(self) -> None:
        if self.inference_capacity is not None and self.inference_capacity <= 0:
            raise ValueError("inference_capacity must be > 0")
        if self.rollout_cpu_s < 0:
            raise ValueError("rollout_cpu_s must be >= 0")
        if self.steps is None and self.scenarios is None:
            raise ValueError("a simulation needs steps or scenarios (or both) to end")
        if self.steps is not None and self.steps < 0:
            raise ValueError("steps must be >= 0")
        if "max_steps" in self.trainer:
            raise ValueError("set the run length with SimSpec.steps, not trainer['max_steps']")
        known = set(trainer_parameter_names())
        unknown = sorted(set(self.trainer) - known)
        if unknown:
            raise ValueError(
                f"not PipelineTrainer parameters: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known - {'max_steps'}))})"
            )
        if not 0 <= self.zero_variance_prob + self.failure_prob <= 1:
            raise ValueError("zero_variance_prob + failure_prob must be within [0, 1]")
        for at, changes in self.resizes:
            if not (math.isfinite(at) and at >= 0):
                raise ValueError(f"a resize's time must be finite and >= 0, not {at!r}")
            bad = sorted(set(changes) - set(RESIZE_PARAMETERS))
            if bad:
                raise ValueError(
                    f"not PipelineTrainer.resize parameters: {', '.join(bad)} "
                    f"(known: {', '.join(RESIZE_PARAMETERS)})"
                )

    def with_trainer(self, **settings: Any) -> SimSpec:
        """A copy with some trainer settings changed."""
        return replace(self, trainer={**self.trainer, **settings})

    def trainer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the simulated `PipelineTrainer` gets."""
        return {**SIM_TRAINER_DEFAULTS, **self.trainer, "max_steps": self.steps}

    def describe(self) -> str:
        """One line: the workload's distributions."""
        parts = [
            f"rollout {describe_distribution(self.rollout_latency)}",
            f"train {describe_distribution(self.train_time)}",
        ]
        if self.eval_time is not None:
            parts.append(f"eval {describe_distribution(self.eval_time)}")
        if self.zero_variance_prob:
            parts.append(f"zero-variance {self.zero_variance_prob:g}")
        if self.failure_prob:
            parts.append(f"failures {self.failure_prob:g}")
        if self.inference_capacity is not None:
            parts.append(f"inference capacity {self.inference_capacity}")
        if self.latency_shift is not None:
            parts.append(self.latency_shift.describe())
        if self.rollout_cpu_s:
            parts.append(f"CPU {self.rollout_cpu_s * 1e6:g} us/rollout")
        for at, changes in self.resizes:
            sizes = ", ".join(f"{k}={v}" for k, v in changes.items())
            parts.append(f"resize at {at:g} s ({sizes})")
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.scenarios is not None:
            parts.append(f"{self.scenarios} scenarios")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (distributions as their short description)."""
        return {
            "rollout_latency": describe_distribution(self.rollout_latency),
            "train_time": describe_distribution(self.train_time),
            "eval_time": None if self.eval_time is None else describe_distribution(self.eval_time),
            "description": self.describe(),
            "zero_variance_prob": self.zero_variance_prob,
            "failure_prob": self.failure_prob,
            "steps": self.steps,
            "scenarios": self.scenarios,
            "seed": self.seed,
            "trainer": {k: _jsonable(v) for k, v in self.trainer.items()},
            "inference_capacity": self.inference_capacity,
            "latency_shift": (
                None if self.latency_shift is None else asdict(self.latency_shift)
            ),
            "rollout_cpu_s": self.rollout_cpu_s,
            "resizes": [[at, dict(changes)] for at, changes in self.resizes],
        }


def parse_value(text: str) -> Any:
    """A trainer setting from the command line: int, float, bool, None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text.strip()


def check_settings(spec: SimSpec) -> None:
    """Raise the trainer's own ValueError for bad settings in `spec`, without running it."""
    # Constructing touches neither the model's directory nor the backend.
    model = trainable_model(
        name="sim", project="art-trio-sim", base_model="sim", base_path=tempfile.gettempdir()
    )
    backend = SyntheticBackend(spec.train_time, Recorder(), seed=spec.seed)
    PipelineTrainer(model, backend, _no_rollout, (), None, None, **spec.trainer_kwargs())


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class SimReport:
    """What one simulated (or real-time) run did. Times are in the run's clock's seconds."""

    spec: dict[str, Any]
    #: The trainer settings that differ from the simulator's baseline (sweep labels).
    settings: dict[str, Any]
    num_rollout_workers: int
    #: `train()` call to its return.
    sim_wall_s: float
    steps: int
    groups_trained: int
    #: Steps per hour of `sim_wall_s`.
    steps_per_hour: float
    #: Time inside `backend.train` over first train start .. last train end (NaN if empty).
    trainer_utilization: float
    #: Rollout-seconds (every rollout's run time, including the part-run of cancelled ones)
    #: over num_rollout_workers x sim_wall_s: how busy the rollout slots (GPUs) were.
    rollout_slot_utilization: float
    rollouts_started: int
    #: Rollouts that completed with a trainable group that was discarded as stale.
    wasted_rollouts: int
    #: `wasted_rollouts` over the rollouts started before the last train step began (the
    #: benchmark's `waste`; definitions in :mod:`art_trio.sim.measures`).
    wasted_share: float
    #: Rollouts cancelled by the trainer because no batch could train them any more
    #: (RunCounters.stale_cancelled).
    cancelled_rollouts: int
    #: Seconds of stale rollouts: completed ones and the part-run of cancelled ones.
    wasted_rollout_s: float
    #: `wasted_rollout_s` over all rollout-seconds.
    wasted_rollout_s_share: float
    rollout_s: float
    #: All rollout-seconds over trained groups: what one trained group costs in inference.
    rollout_s_per_trained_group: float
    #: Rollouts that were still running, queued or ready when the run ended (the end of a
    #: finite run, not waste of the schedule), and their seconds.
    end_of_run_rollouts: int
    end_of_run_rollout_s: float
    failed_rollouts: int
    zero_variance_groups: int
    #: Trained groups by staleness: step trained from (step - 1) minus initial policy version.
    staleness: dict[int, int]
    #: Groups delivered and not yet batched (channel + ready), averaged over `sim_wall_s`.
    mean_queue_depth: float
    max_queue_depth: int
    evals: int
    #: Cut short at the virtual time limit (the pipeline stopped making progress).
    stalled: bool
    #: Wall-clock seconds the simulation itself took.
    real_s: float
    virtual: bool = True
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        return mean_staleness(self.staleness)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (NaN becomes None)."""
        data = asdict(self)
        data["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        data["mean_staleness"] = self.mean_staleness
        return {k: _jsonable(v) for k, v in data.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


async def _noop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for `model.log`: writing metrics is not what is simulated."""


class _QueueMeter:
    """Time-integral of the groups queued for the trainer, from the trainer's events.

    A group joins the queue when a worker hands it over (`GroupQueued`) and leaves it when
    the trainer takes it into a batch (`BatchTaken`) or discards it (a `ScenarioSettled`
    with `queued`). Integrated at every change, in virtual time: exact, no sampling.
    """

    def __init__(self, now: float) -> None:
        self.area = 0.0
        self.depth = 0
        self.last = now
        #: Scenarios the run's end left behind (still running, queued or ready).
        self.dropped: set[int] = set()

    def _change(self, delta: int) -> None:
        now = trio.current_time()
        self.area += self.depth * (now - self.last)
        self.last = now
        self.depth += delta

    def __call__(self, event: RunEvent) -> None:
        if isinstance(event, GroupQueued):
            self._change(1)
        elif isinstance(event, BatchTaken):
            self._change(-event.batch_size)
        elif isinstance(event, ScenarioSettled):
            if event.queued and event.fate is not Fate.TRAINED:
                self._change(-1)
            if event.fate is Fate.DROPPED_AT_STOP:
                self.dropped.add(event.scenario_index)

    def close(self, now: float) -> None:
        self.area += self.depth * (now - self.last)
        self.last = now


class _QuietStdout(io.TextIOBase):
    """Stands in for stdout during a run: never a TTY (so the trainer draws no status bar),
    keeps the last lines for an error report, and swallows the periodic `[status]` lines."""

    def __init__(self, keep: int = 40) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        self.count = 0

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                self.lines.append(line)
                self.count += 1
        return len(text)


@dataclass
class _Outcome:
    recorder: Recorder
    counters: RunCounters
    dropped: set[int]
    workers: int
    queue_area: float
    stalled: bool


async def _drive(
    spec: SimSpec,
    base_path: str,
    on_step: Callable[[], None] | None,
    time_limit_s: float | None,
    timeline: Path | None = None,
) -> _Outcome:
    recorder = Recorder(detailed=True)
    model: Any = trainable_model(
        name="sim", project="art-trio-sim", base_model="sim", base_path=base_path
    )
    backend = SyntheticBackend(spec.train_time, recorder, seed=spec.seed, on_step=on_step)
    await model.register(backend)
    # TrainableModel is pydantic; object.__setattr__ puts the stub in the instance dict.
    object.__setattr__(model, "log", _noop_log)
    eval_fn = (
        None
        if spec.eval_time is None
        else trio_native(eval_double(spec.eval_time, recorder, seed=spec.seed))
    )
    kwargs = spec.trainer_kwargs()
    # The rollout double needs the resolved settings (for its description): the trainer's
    # own resolution of the same arguments.
    resolved = PipelineTrainer(model, backend, _no_rollout, [], None, **kwargs).settings
    workload = Workload(
        name="sim",
        workers=resolved.sizes.num_rollout_workers,
        rollout_latency=spec.rollout_latency,
        train_time=spec.train_time,
        min_batch=resolved.sizes.min_batch_size,
        max_batch=resolved.sizes.max_batch_size,
        max_steps_off_policy=resolved.freshness.max_steps_off_policy,
        steps=spec.steps,
        seed=spec.seed,
        zero_variance_prob=spec.zero_variance_prob,
        failure_prob=spec.failure_prob,
        # Two trajectories are enough for reward variance and cheapest to build.
        trajectories_per_group=2,
        scenarios=spec.scenarios,
        inference_capacity=spec.inference_capacity,
        latency_shift=spec.latency_shift,
        rollout_cpu_s=spec.rollout_cpu_s,
    )
    trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
        model,
        backend,
        trio_native(make_rollout_fn(workload, recorder)),
        scenarios(spec.scenarios),
        None,
        eval_fn,
        **kwargs,
    )
    limit = math.inf if time_limit_s is None else time_limit_s
    recorder.train_called_at = anyio.current_time()
    meter = _QueueMeter(recorder.train_called_at)
    trainer.add_observer(meter)
    started = recorder.train_called_at
    # The event log on the run's own clock: virtual seconds, as a real run's are real ones.
    recording = contextlib.nullcontext() if timeline is None else record_timeline(trainer, timeline)
    failed: Exception | None = None
    async with anyio.create_task_group() as resizing:
        if spec.resizes:
            resizing.start_soon(_resize_on_schedule, trainer, spec.resizes, started)
        with anyio.move_on_after(limit) as limit_scope, recording:
            try:
                await trainer.train(handle_signals=False)
            except Exception as exc:
                # Raised below as train() raised it, not grouped by the resizer's task group.
                failed = exc
        resizing.cancel_scope.cancel()
    if failed is not None:
        raise failed
    recorder.train_returned_at = anyio.current_time()
    meter.close(recorder.train_returned_at)
    counters = trainer.last_counters
    if counters is None:
        raise RuntimeError("the simulated run ended before it started (time limit too short?)")
    return _Outcome(
        recorder=recorder,
        counters=counters,
        dropped=meter.dropped,
        workers=trainer.num_rollout_workers,
        queue_area=meter.area,
        stalled=limit_scope.cancelled_caught,
    )


async def _resize_on_schedule(
    trainer: PipelineTrainer[Any, Any],
    resizes: Sequence[tuple[float, Mapping[str, int]]],
    started: float,
) -> None:
    for at, changes in sorted(resizes, key=lambda r: r[0]):
        await anyio.sleep_until(started + at)
        trainer.resize(**changes, reason=f"simulated resize at {at:g} s")


async def _no_rollout(model: Any, scenario: Any, config: Any) -> Any:
    raise AssertionError("never called: the trainer it belongs to never trains")


_COUNTER_NAMES = (
    "taken",
    "trained",
    "stale",
    "stale_cancelled",
    "zero_variance",
    "errored",
    "dropped_at_stop",
    "rollouts_started",
    "steps",
)


def _tally(outcome: _Outcome) -> RolloutTally:
    """The shared rollout accounting, with the trainer's own events saying exactly which
    rollouts the run's end left behind (dropped at stop: still running, queued or ready)."""
    dropped = outcome.dropped
    return tally_rollouts(
        outcome.recorder,
        train_window(outcome.recorder.steps),
        left_at_end=lambda sid: sid in dropped,
    )


def _report(spec: SimSpec, outcome: _Outcome, *, real_s: float, virtual: bool) -> SimReport:
    rec, counters = outcome.recorder, outcome.counters
    assert rec.train_called_at is not None and rec.train_returned_at is not None
    wall = rec.train_returned_at - rec.train_called_at
    window = train_window(rec.steps)
    tally = _tally(outcome)
    return SimReport(
        spec=spec.to_dict(),
        settings={k: _jsonable(v) for k, v in spec.trainer.items()},
        num_rollout_workers=outcome.workers,
        sim_wall_s=wall,
        steps=window.steps,
        groups_trained=window.groups,
        steps_per_hour=ratio(window.steps * 3600, wall),
        trainer_utilization=window.utilization,
        rollout_slot_utilization=ratio(tally.paid_s, outcome.workers * wall),
        rollouts_started=rec.started,
        wasted_rollouts=tally.wasted,
        wasted_share=tally.waste,
        cancelled_rollouts=counters.stale_cancelled,
        wasted_rollout_s=tally.wasted_s,
        wasted_rollout_s_share=ratio(tally.wasted_s, tally.paid_s),
        rollout_s=tally.paid_s,
        rollout_s_per_trained_group=ratio(tally.paid_s, window.groups),
        end_of_run_rollouts=tally.left_at_end,
        end_of_run_rollout_s=tally.left_at_end_s,
        failed_rollouts=rec.failed,
        zero_variance_groups=rec.zero_variance,
        staleness=dict(sorted(Counter(counters.staleness).items())),
        mean_queue_depth=ratio(outcome.queue_area, wall),
        max_queue_depth=counters.max_queued,
        evals=len(rec.evals),
        stalled=outcome.stalled,
        real_s=real_s,
        virtual=virtual,
        counters={name: getattr(counters, name) for name in _COUNTER_NAMES},
    )


def simulate(
    spec: SimSpec,
    *,
    real_time: bool = False,
    on_step: Callable[[], None] | None = None,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    trainer_output: TextIO | None = None,
    timeline: str | Path | None = None,
) -> SimReport:
    """Run `spec` through art_trio's PipelineTrainer and measure it (blocking).

    Virtual time by default (`trio.run` with `MockClock(autojump_threshold=0)`); with
    ``real_time=True`` the same run sleeps for real. ``on_step`` is called after every train
    step (progress bars). What the trainer prints goes to ``trainer_output`` (default:
    discarded; stdout is never a TTY meanwhile, so the trainer draws no status bar); if the
    run raises, its last lines are written to stderr. ``timeline``: record the run's events
    there (an `art_trio.timeline` log, in virtual seconds) to draw it as a real run is drawn.
    Must not be called from inside a running event loop.
    """
    quiet = _QuietStdout()
    sink: TextIO = trainer_output if trainer_output is not None else quiet  # type: ignore[assignment]
    clock = None if real_time else trio.testing.MockClock(autojump_threshold=0)
    limit = None if real_time else time_limit_s
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="art-trio-sim-") as tmp:
        log = None if timeline is None else Path(timeline)
        drive = functools.partial(_drive, spec, tmp, on_step, limit, log)
        try:
            with contextlib.redirect_stdout(sink), _repeatable_scheduling(spec.seed):
                outcome = trio.run(drive, clock=clock)
        except BaseException:
            if quiet.lines:
                print("Last lines the trainer printed:", file=sys.stderr)
                for line in quiet.lines:
                    print(f"  {line}", file=sys.stderr)
            raise
    return _report(spec, outcome, real_s=time.perf_counter() - started, virtual=not real_time)


@contextlib.contextmanager
def _repeatable_scheduling(seed: int) -> Iterator[None]:
    """Trio runs the tasks that became ready together in an order it draws at random (so that
    no code comes to depend on one); in virtual time many rollouts end in the same instant,
    and the draws would make a seeded run differ from one repeat to the next. Seed them, as
    pytest-trio does for Hypothesis (trio's own switch for it; the run is as it was where the
    switch is gone)."""
    core = getattr(getattr(trio, "_core", None), "_run", None)
    rng = getattr(core, "_r", None)
    if core is None or not hasattr(core, "_ALLOW_DETERMINISTIC_SCHEDULING") or rng is None:
        yield
        return
    allowed, state = core._ALLOW_DETERMINISTIC_SCHEDULING, rng.getstate()
    core._ALLOW_DETERMINISTIC_SCHEDULING = True
    rng.seed(seed)
    try:
        yield
    finally:
        core._ALLOW_DETERMINISTIC_SCHEDULING = allowed
        rng.setstate(state)


# --------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    """One report per combination of the grid, in grid order, and the cheapest among them."""

    grid: dict[str, list[Any]]
    target: float
    reports: list[SimReport]
    #: Index into `reports` of the cheapest setting reaching `target`, or None if none does.
    best: int | None

    @property
    def best_report(self) -> SimReport | None:
        return None if self.best is None else self.reports[self.best]

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid": {k: [_jsonable(v) for v in vs] for k, vs in self.grid.items()},
            "target": self.target,
            "best": self.best,
            "best_settings": None if self.best is None else self.reports[self.best].settings,
            "reports": [r.to_dict() for r in self.reports],
        }


def combinations(grid: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
    """The grid's settings, the last key varying fastest."""
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values, strict=True))


def cheapest(reports: Sequence[SimReport], target: float = DEFAULT_TARGET) -> int | None:
    """Index of the cheapest report whose trainer utilization is at least `target`.

    Cheapest: fewest rollout workers (what is paid for by the hour), then the fewest
    rollout-seconds spent per trained group (inference thrown away on stale groups), then
    the earliest in the list. None if no report reaches `target` (or none trained).
    """
    eligible = [
        i
        for i, r in enumerate(reports)
        if not r.stalled
        and r.trainer_utilization >= target  # NaN compares False: untrained runs never qualify
        and not math.isnan(r.rollout_s_per_trained_group)
    ]
    if not eligible:
        return None
    return min(
        eligible,
        key=lambda i: (
            reports[i].num_rollout_workers,
            reports[i].rollout_s_per_trained_group,
            i,
        ),
    )


def sweep(
    spec: SimSpec,
    grid: Mapping[str, Sequence[Any]],
    *,
    target: float = DEFAULT_TARGET,
    on_run: Callable[[int, dict[str, Any]], None] | None = None,
    on_step: Callable[[], None] | None = None,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
) -> SweepResult:
    """Simulate every combination of `grid` (trainer settings over `spec`), one after another.

    ``on_run(index, settings)`` is called before each run. The report's ``settings`` holds
    the spec's trainer settings with the combination applied.
    """
    if not grid:
        raise ValueError("a sweep needs at least one setting to vary")
    for name, values in grid.items():
        if not values:
            raise ValueError(f"sweep of {name} has no values")
    reports: list[SimReport] = []
    for index, combo in enumerate(combinations(grid)):
        if on_run is not None:
            on_run(index, combo)
        reports.append(
            simulate(spec.with_trainer(**combo), on_step=on_step, time_limit_s=time_limit_s)
        )
    return SweepResult(
        grid={k: list(v) for k, v in grid.items()},
        target=target,
        reports=reports,
        best=cheapest(reports, target),
    )
