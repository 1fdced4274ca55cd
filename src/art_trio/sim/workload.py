"""Workload doubles: latency distributions, a synthetic backend, rollout/eval callbacks, metrics.

The doubles stand in for an LLM inference server (rollouts) and a trainer (``backend.train``)
with sleeps drawn from seeded distributions, and record what the pipeline trainer did with
them: when each rollout started and finished, which groups every train step got, and at
which policy version those groups were started. :func:`measure` turns those records into a
:class:`RunReport` (throughput, trainer utilization, wasted rollouts, staleness, ...).

They await only anyio primitives (``anyio.sleep``, ``anyio.current_time``), so the very same
objects work under ART's asyncio ``PipelineTrainer``, under art_trio on trio or on asyncio, and
under trio's ``MockClock`` where time is virtual.

Latency draws are indexed by scenario id (not by the order in which rollouts happen to start),
so two trainers fed the same workload and seed see the same latency for the same scenario.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import sys
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import anyio
import numpy as np

# ART pulls in litellm, which downloads a price map at import time unless told not to; this
# machine (and CI) has no network for that. It must be set before the first ``import art``.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
from art.types import TrainResult  # noqa: E402

__all__ = [
    "PRESETS",
    "SCHEDULING_WORKLOADS",
    "OVERHEAD_WORKLOADS",
    "MEMORY_WORKLOADS",
    "Constant",
    "Empirical",
    "Exponential",
    "LatencyDist",
    "LogNormal",
    "Recorder",
    "RolloutFailed",
    "RunReport",
    "StepRecord",
    "SyntheticBackend",
    "Workload",
    "make_eval_fn",
    "make_rollout_fn",
    "measure",
    "peak_rss_bytes",
    "current_rss_bytes",
    "scenarios",
]


# --------------------------------------------------------------------------------------------
# Latency distributions
# --------------------------------------------------------------------------------------------


class LatencyDist(ABC):
    """A distribution of durations in seconds, sampled from a caller-supplied Generator."""

    @property
    @abstractmethod
    def mean(self) -> float:
        """The distribution's expected value, in seconds."""

    @abstractmethod
    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` non-negative durations."""

    @abstractmethod
    def describe(self) -> str:
        """Short human-readable form for tables, e.g. ``exp(50ms)``."""

    def sample(self, rng: np.random.Generator) -> float:
        """Draw one duration."""
        return float(self.sample_n(rng, 1)[0])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g}ms"


@dataclass(frozen=True)
class Constant(LatencyDist):
    """Always ``seconds`` (``0`` means "yield once and go on")."""

    seconds: float

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError("Constant latency must be >= 0")

    @property
    def mean(self) -> float:
        return self.seconds

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.seconds, dtype=float)

    def describe(self) -> str:
        return _ms(self.seconds)


@dataclass(frozen=True)
class Exponential(LatencyDist):
    """Exponential with the given mean (memoryless; many short, a few long)."""

    mean_s: float

    def __post_init__(self) -> None:
        if self.mean_s <= 0:
            raise ValueError("Exponential mean must be > 0")

    @property
    def mean(self) -> float:
        return self.mean_s

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean_s, n)

    def describe(self) -> str:
        return f"exp({_ms(self.mean_s)})"


@dataclass(frozen=True)
class LogNormal(LatencyDist):
    """Log-normal parameterised by its *mean* (not median) and the log-space sigma.

    ``mu = ln(mean) - sigma**2 / 2`` so the mean stays put as ``sigma`` grows and only the
    tail gets heavier: sigma 1.5 puts the median at a third of the mean.
    """

    mean_s: float
    sigma: float

    def __post_init__(self) -> None:
        if self.mean_s <= 0 or self.sigma < 0:
            raise ValueError("LogNormal needs mean > 0 and sigma >= 0")

    @property
    def mean(self) -> float:
        return self.mean_s

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean_s) - self.sigma**2 / 2
        return rng.lognormal(mu, self.sigma, n)

    def describe(self) -> str:
        return f"lognorm({_ms(self.mean_s)},s={self.sigma:g})"


@dataclass(frozen=True)
class Empirical(LatencyDist):
    """Resample (with replacement) from measured durations, e.g. production rollout times."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Empirical needs at least one sample")
        if min(self.samples) < 0:
            raise ValueError("Empirical samples must be >= 0")

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples))

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.samples, dtype=float), size=n, replace=True)

    def describe(self) -> str:
        return f"empirical(n={len(self.samples)},mean={_ms(self.mean)})"


class IndexedDraws:
    """Draw number ``i`` of a seeded stream, whatever order the indices are asked for in.

    Draws are generated in fixed-size chunks in index order, so ``draws[i]`` depends only on
    the seed and ``i``. Rollouts of scenario ``i`` therefore take the same time under every
    trainer, and a trainer that starts scenarios in a different order is not handed different
    luck.
    """

    CHUNK = 4096

    def __init__(
        self, draw: Callable[[np.random.Generator, int], np.ndarray], seed: Sequence[int]
    ) -> None:
        self._draw = draw
        self._rng = np.random.default_rng(list(seed))
        self._chunks: list[np.ndarray] = []

    def __getitem__(self, index: int) -> float:
        if index < 0:
            raise IndexError(index)
        chunk = index // self.CHUNK
        while len(self._chunks) <= chunk:
            self._chunks.append(self._draw(self._rng, self.CHUNK))
        return float(self._chunks[chunk][index % self.CHUNK])


def _draws_for(dist: LatencyDist, seed: Sequence[int]) -> Callable[[int], float]:
    # A constant needs no table; skipping it keeps the memory workload's own footprint flat.
    if isinstance(dist, Constant):
        value = dist.seconds
        return lambda _index: value
    return IndexedDraws(dist.sample_n, seed).__getitem__


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One benchmark scenario: how long things take and how the trainer is configured."""

    name: str
    workers: int
    rollout_latency: LatencyDist
    train_time: LatencyDist
    min_batch: int
    max_batch: int
    #: The hard staleness bound (None: off, ART 0.5.20+).
    max_steps_off_policy: int | None
    #: Train steps (``max_steps``); ``None`` runs until the scenarios run out.
    steps: int | None = 20
    seed: int = 0
    #: Seconds one eval takes; ``None`` means no ``eval_fn`` at all.
    eval_time: float | None = None
    eval_every_n_steps: int = 20
    zero_variance_prob: float = 0.0
    failure_prob: float = 0.0
    trajectories_per_group: int = 4
    #: Number of scenarios fed in; ``None`` is an endless stream.
    scenarios: int | None = None
    #: Keep per-rollout and per-group records (needed for waste); off for the memory run so
    #: the harness's own bookkeeping does not grow with the run.
    detailed: bool = True
    #: Trained-group counts at which peak RSS is sampled.
    rss_checkpoints: tuple[int, ...] = ()
    description: str = ""
    #: ART 0.5.20's mean policy-age bound (None: off); trainers without it cannot run this.
    limit_mean_steps_off_policy: float | None = None

    def __post_init__(self) -> None:
        if self.workers <= 0 or self.min_batch <= 0 or self.max_batch < self.min_batch:
            raise ValueError(f"invalid workload {self.name!r}")
        if not 0 <= self.zero_variance_prob + self.failure_prob <= 1:
            raise ValueError("zero_variance_prob + failure_prob must be within [0, 1]")
        if self.trajectories_per_group < 2:
            raise ValueError("need >= 2 trajectories per group for non-zero reward variance")

    def with_(self, **changes: Any) -> Workload:
        """A copy with some fields changed (``steps=5``, ``seed=3``, ...)."""
        return replace(self, **changes)

    def describe(self) -> str:
        """One line: the parameters that matter for scheduling."""
        return (
            f"{self.workers} workers, rollout {self.rollout_latency.describe()}, "
            f"train {self.train_time.describe()}, batch {self.min_batch}..{self.max_batch}, "
            f"off-policy {self.max_steps_off_policy}, "
            + (
                f"mean age <= {self.limit_mean_steps_off_policy}, "
                if self.limit_mean_steps_off_policy is not None
                else ""
            )
            + (f"{self.steps} steps" if self.steps is not None else f"{self.scenarios} scenarios")
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (distributions as their short description)."""
        data = asdict(self)
        data["rollout_latency"] = self.rollout_latency.describe()
        data["train_time"] = self.train_time.describe()
        return data


def _scheduling(name: str, **kw: Any) -> Workload:
    base: dict[str, Any] = dict(
        workers=64,
        rollout_latency=Exponential(0.05),
        train_time=Constant(0.1),
        min_batch=8,
        max_batch=8,
        max_steps_off_policy=1,
        steps=20,
    )
    base.update(kw)
    return Workload(name=name, **base)


def _overhead(*, batch: int) -> Workload:
    return Workload(
        name=f"overhead-b{batch}",
        workers=64,
        rollout_latency=Constant(0.0),
        train_time=Constant(0.0),
        min_batch=batch,
        max_batch=batch,
        max_steps_off_policy=1,
        steps=2000,
        description=f"zero-latency rollouts and train: scheduler overhead, batch {batch}",
    )


#: The six scheduling workloads from the "Scheduler performance" issue (ART numbers measured
#: on ART 0.5.18's asyncio trainer), then the overhead and memory workloads.
PRESETS: dict[str, Workload] = {
    w.name: w
    for w in (
        _scheduling(
            "plenty-off1",
            description="rollout capacity far above training demand, 1 step off-policy",
        ),
        _scheduling("plenty-off2", max_steps_off_policy=2, description="as plenty-off1, 2 off"),
        _scheduling("on-policy", max_steps_off_policy=0, description="strictly on-policy"),
        _scheduling(
            "heavy-tail",
            rollout_latency=LogNormal(0.05, 1.5),
            description="plenty-off1 with log-normal (sigma 1.5) rollout times",
        ),
        _scheduling(
            "tight-off1",
            workers=32,
            rollout_latency=Exponential(0.2),
            description="rollout capacity only ~2x training demand",
        ),
        _scheduling(
            "mean-bound",
            max_steps_off_policy=None,
            limit_mean_steps_off_policy=1.0,
            description="plenty-off1 under ART 0.5.20's mean policy-age bound (1.0) alone",
        ),
        _scheduling(
            "defaults",
            workers=16,
            min_batch=4,
            max_batch=40,
            max_steps_off_policy=4,
            description="ART's default knobs (16 workers, batch 4..40, 4 off-policy)",
        ),
        _overhead(batch=32),
        _overhead(batch=1),
        Workload(
            name="memory",
            workers=64,
            rollout_latency=Constant(0.0),
            train_time=Constant(0.0),
            min_batch=32,
            max_batch=32,
            max_steps_off_policy=4,
            steps=None,
            scenarios=100_000,
            detailed=False,
            rss_checkpoints=(10_000,),
            description="100k scenarios through the pipeline; peak RSS must stay flat",
        ),
    )
}

SCHEDULING_WORKLOADS: tuple[str, ...] = (
    "plenty-off1",
    "mean-bound",
    "plenty-off2",
    "on-policy",
    "heavy-tail",
    "tight-off1",
    "defaults",
)
OVERHEAD_WORKLOADS: tuple[str, ...] = ("overhead-b32", "overhead-b1")
MEMORY_WORKLOADS: tuple[str, ...] = ("memory",)


def scenarios(count: int | None) -> Iterator[dict[str, Any]]:
    """Scenario dicts ``{"id": i, "metadata": {"scenario_id": i}}``; endless if ``count`` is None.

    The ``metadata.scenario_id`` form is what ART copies into ``group.metadata``; the rollout
    double sets it on the group itself too, so nothing depends on the trainer doing that.
    """
    i = 0
    while count is None or i < count:
        yield {"id": i, "metadata": {"scenario_id": i}}
        i += 1


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


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
        versions = [_group_initial_version(g) for g in groups]
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


def _group_initial_version(group: art.TrajectoryGroup) -> int | None:
    versions = [
        t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None
    ]
    return min(versions) if versions else None


def _group_scenario_id(group: art.TrajectoryGroup) -> int:
    value = group.metadata.get("scenario_id", -1)
    return int(value) if isinstance(value, (int, float, str)) else -1


# --------------------------------------------------------------------------------------------
# The doubles
# --------------------------------------------------------------------------------------------


class SyntheticBackend:
    """An ``art.Backend`` whose ``train`` just sleeps, and which records every step.

    Implements what the pipeline trainers call: ``register``, ``_get_step``, ``train``,
    ``_model_inference_name``, ``_prepare_backend_for_training``, ``_delete_checkpoint_files``
    and ``close``. It has neither ``adapter_lease`` nor ``prune_model_adapters``, so trainers
    skip those paths.
    """

    def __init__(
        self,
        train_time: LatencyDist,
        recorder: Recorder,
        *,
        seed: int = 0,
        initial_step: int = 0,
    ) -> None:
        self.recorder = recorder
        self.step = initial_step
        self.train_calls = 0
        self.closed = False
        self._train_times = _draws_for(train_time, (seed, 2))

    async def register(self, model: Any) -> None:
        """Nothing to set up; the model just needs a backend object."""

    async def _get_step(self, model: Any) -> int:
        return self.step

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{step}" if step is not None else str(model.name)

    async def _prepare_backend_for_training(
        self, model: Any, config: Any = None
    ) -> tuple[str, str]:
        # Never dialled: the rollout double does not talk to an inference server.
        return "http://synthetic.invalid/v1", "synthetic"

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        """No checkpoints are written, so there is nothing to delete."""

    async def close(self) -> None:
        self.closed = True

    async def train(
        self, model: Any, trajectory_groups: Iterable[art.TrajectoryGroup], **kwargs: Any
    ) -> TrainResult:
        """Sleep the step's train time, bump the step and record the batch."""
        groups = list(trajectory_groups)
        start = anyio.current_time()
        base_version = self.step
        duration = self._train_times(self.train_calls)
        self.train_calls += 1
        await anyio.sleep(duration)
        self.step += 1
        end = anyio.current_time()
        self.recorder.record_step(
            step=self.step, base_version=base_version, start=start, end=end, groups=groups
        )
        return TrainResult(step=self.step, metrics={})


class RolloutFailed(RuntimeError):
    """Raised by the rollout double for scenarios drawn to fail."""


RolloutFn = Callable[[Any, dict[str, Any], Any], Awaitable[art.TrajectoryGroup]]
EvalFn = Callable[[Any, int, Any], Awaitable[list[art.Trajectory | art.TrajectoryGroup]]]

# One tiny exchange per trajectory: trainers pass messages through untouched, and a realistic
# payload size is not what these benchmarks measure.
_MESSAGES: list[Any] = [
    {"role": "user", "content": "ping"},
    {"role": "assistant", "content": "pong"},
]
#: What a serving response's usage would give; ART 0.5.20+'s trainer refuses groups without it.
_USAGE: dict[str, float | int | bool] = {"completion_tokens": 1}


def _asyncio_now() -> float:
    return asyncio.get_running_loop().time()


def make_rollout_fn(workload: Workload, recorder: Recorder, *, flavor: str = "anyio") -> RolloutFn:
    """A ``rollout_fn(model, scenario, config) -> TrajectoryGroup`` for ``workload``.

    ``flavor="asyncio"`` makes it asyncio code (``asyncio.sleep``, the loop's clock), as ART
    users' rollouts are: under trio it then crosses the trio-asyncio bridge, the path users
    take. ``"anyio"`` (default) runs natively on either loop (the simulator's and the
    benchmark's ``trio-native`` kind).

    It records the start, sleeps the scenario's latency (recording a cancellation if it is
    cancelled meanwhile), then (by a per-scenario draw) fails
    with :class:`RolloutFailed`, returns a zero-variance group (all rewards equal, which
    trainers discard), or returns a group of ``trajectories_per_group`` distinct rewards.
    The group carries ``metadata["scenario_id"]``.
    """
    latency = _draws_for(workload.rollout_latency, (workload.seed, 1))
    outcome_p = workload.failure_prob + workload.zero_variance_prob
    uniform: Callable[[int], float] = (
        IndexedDraws(lambda rng, n: rng.random(n), (workload.seed, 3)).__getitem__
        if outcome_p > 0
        else (lambda _index: 1.0)
    )
    n = workload.trajectories_per_group
    varied = tuple(i / (n - 1) for i in range(n))
    flat = (0.5,) * n

    if flavor == "asyncio":
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        now: Callable[[], float] = _asyncio_now
    elif flavor == "anyio":
        sleep, now = anyio.sleep, anyio.current_time
    else:
        raise ValueError(f"flavor must be 'anyio' or 'asyncio', got {flavor!r}")

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        scenario_id = int(scenario["id"])
        recorder.rollout_started(scenario_id, now())
        try:
            await sleep(latency(scenario_id))
        except BaseException:
            # Cancelled mid-rollout (a trainer dropping a doomed rollout, or shutdown): the
            # inference time spent so far is still spent, so it is recorded.
            recorder.rollout_cancelled(scenario_id, now())
            raise
        u = uniform(scenario_id)
        if u < workload.failure_prob:
            recorder.rollout_finished(scenario_id, now(), "failed")
            raise RolloutFailed(f"synthetic failure of scenario {scenario_id}")
        zero_variance = u < outcome_p
        group = art.TrajectoryGroup(
            [
                art.Trajectory(
                    messages_and_choices=list(_MESSAGES), reward=reward, metrics=_USAGE.copy()
                )
                for reward in (flat if zero_variance else varied)
            ],
            metadata={"scenario_id": scenario_id},
        )
        recorder.rollout_finished(
            scenario_id, now(), "zero_variance" if zero_variance else "ok"
        )
        return group

    return rollout


def make_eval_fn(workload: Workload, recorder: Recorder) -> EvalFn | None:
    """An ``eval_fn(model, step, config)`` sleeping ``workload.eval_time``, or None if unset."""
    eval_time = workload.eval_time
    if eval_time is None:
        return None

    async def evaluate(
        model: Any, step: int, config: Any
    ) -> list[art.Trajectory | art.TrajectoryGroup]:
        start = anyio.current_time()
        await anyio.sleep(eval_time)
        recorder.evals.append((step, start, anyio.current_time()))
        return [
            art.Trajectory(messages_and_choices=list(_MESSAGES), reward=1.0, metrics=_USAGE.copy())
        ]

    return evaluate


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


@dataclass
class RunReport:
    """What one trainer run did with one workload (see :func:`measure` for definitions)."""

    steps: int
    groups: int
    #: First train start to last train end.
    window_s: float
    steps_per_s: float
    groups_per_s: float
    #: Share of the window the trainer spent inside ``backend.train``.
    utilization: float
    #: Rollouts started and completed before the last step's start but never trained, over all
    #: rollouts started before it. ``None`` without detailed records.
    waste: float | None
    #: As ``waste``, but also counting rollouts that completed during the last step (which no
    #: trainer could still put in a batch: the end-of-run tail).
    waste_incl_tail: float | None
    wasted: int | None
    started_before_last_step: int | None
    #: Of the rollouts started before the last step's start, the share cancelled before they
    #: completed (a trainer dropping rollouts no batch can use any more).
    cancelled_share: float | None
    #: Rollout-seconds spent on rollouts started before the last step's start that were never
    #: trained (stale, left over, cancelled part-way, or run out at the end), over all
    #: rollout-seconds of those rollouts: the inference capacity thrown away.
    wasted_work: float | None
    #: Every rollout-second paid (all rollouts, cancelled and unfinished ones included, until
    #: they ended or ``train()`` returned) per trained group: what inference costs per group.
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


_MB = 1024 * 1024


def measure(records: Recorder) -> RunReport:
    """Compute a :class:`RunReport` from a finished run's records.

    * steady window: first train start to last train end; steps/s, groups/s and utilization
      (time inside ``train`` / window) are over it;
    * waste: of the rollouts started before the last step began (only those could have been
      trained), the share that completed with a trainable group, also before the last step
      began, and was never trained. Rollouts finishing during the last step are the
      end-of-run tail, which no trainer can still batch; ``waste_incl_tail`` counts them too.
      (On ART 0.5.18 ``waste`` lands within a few points of the issue's numbers, e.g. 0.83
      on-policy, 0.51 tight-off1, 0.001 defaults; ``waste_incl_tail`` runs 2-8 points higher.)
      Failed and zero-variance rollouts are not waste of the scheduler's making and are not
      counted as wasted (they stay in the denominator). A trainer that *cancels* doomed
      rollouts lowers ``waste`` without saving all their cost, hence also:
    * cancelled share: of the same rollouts, the share cancelled before completing;
    * wasted work: rollout-seconds of the same rollouts that were never trained (including
      the part-run of cancelled ones and the end-of-run tail) over all their rollout-seconds;
    * staleness: trained groups by ``base_version - initial_policy_version`` (0 = on-policy);
    * return latency: last train end to ``train()`` returning (needs ``train_returned_at``);
    * CPU: process CPU seconds in ``train()`` (if the runner set ``train_cpu_s``), per group;
    * peak RSS: ``getrusage`` peak of this process, sampled now.
    """
    steps = records.steps
    groups = sum(s.n_groups for s in steps)
    if steps:
        first_start = min(s.start for s in steps)
        last_end = max(s.end for s in steps)
        window = last_end - first_start
        busy = sum(s.end - s.start for s in steps)
    else:
        first_start = last_end = math.nan
        window = 0.0
        busy = 0.0
    if window > 0:
        steps_per_s, groups_per_s, utilization = len(steps) / window, groups / window, busy / window
    else:
        # Zero-length window (instant train in virtual time, or no steps): rates undefined.
        steps_per_s = groups_per_s = utilization = math.nan

    waste: float | None = None
    waste_incl_tail: float | None = None
    cancelled_share: float | None = None
    wasted_work: float | None = None
    wasted: int | None = None
    eligible: int | None = None
    paid_per_group: float | None = None
    if records.detailed and steps:
        last_start = max(s.start for s in steps)
        # Rollouts never seen to end ran at least until train() returned.
        open_end = records.train_returned_at if records.train_returned_at is not None else last_end
        trained = {sid for s in steps for sid in s.scenario_ids}
        eligible = wasted = wasted_tail = cancelled = 0
        work = wasted_seconds = 0.0
        for sid, started_at in records.rollout_start.items():
            if started_at >= last_start:
                continue
            eligible += 1
            ended_at = records.rollout_end.get(sid)
            outcome = records.rollout_outcome.get(sid)
            seconds = max(0.0, (open_end if ended_at is None else ended_at) - started_at)
            work += seconds
            if sid not in trained and outcome not in ("failed", "zero_variance"):
                wasted_seconds += seconds
            if outcome == "cancelled":
                cancelled += 1
            if ended_at is None or outcome != "ok" or sid in trained:
                continue
            if ended_at < last_start:
                wasted += 1
            else:
                wasted_tail += 1
        waste = wasted / eligible if eligible else math.nan
        waste_incl_tail = (wasted + wasted_tail) / eligible if eligible else math.nan
        cancelled_share = cancelled / eligible if eligible else math.nan
        wasted_work = wasted_seconds / work if work > 0 else math.nan
        paid = sum(
            max(0.0, records.rollout_end.get(sid, open_end) - started_at)
            for sid, started_at in records.rollout_start.items()
        )
        paid_per_group = paid / groups if groups else math.nan

    return_latency = (
        records.train_returned_at - last_end
        if records.train_returned_at is not None and steps
        else None
    )
    wall = (
        records.train_returned_at - records.train_called_at
        if records.train_returned_at is not None and records.train_called_at is not None
        else None
    )
    peak = peak_rss_bytes()
    rss = [(s.groups_trained, s.peak_bytes / _MB) for s in records.rss_samples]
    if not rss or rss[-1][0] != records.groups_trained:
        rss.append((records.groups_trained, peak / _MB))
    return RunReport(
        steps=len(steps),
        groups=groups,
        window_s=window,
        steps_per_s=steps_per_s,
        groups_per_s=groups_per_s,
        utilization=utilization,
        waste=waste,
        waste_incl_tail=waste_incl_tail,
        wasted=wasted,
        started_before_last_step=eligible,
        cancelled_share=cancelled_share,
        wasted_work=wasted_work,
        rollout_s_per_group=paid_per_group,
        staleness=dict(sorted(records.staleness.items())),
        return_latency_s=return_latency,
        wall_s=wall,
        cpu_s=records.train_cpu_s,
        cpu_us_per_group=(
            records.train_cpu_s / groups * 1e6
            if records.train_cpu_s is not None and groups
            else None
        ),
        peak_rss_mb=peak / _MB,
        rss_mb=rss,
        rollouts_started=records.started,
        rollouts_completed=records.completed,
        rollouts_cancelled=records.cancelled,
        rollouts_failed=records.failed,
        zero_variance=records.zero_variance,
    )
