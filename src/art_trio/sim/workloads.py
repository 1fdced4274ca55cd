"""Benchmark and simulator workloads: how long things take and how the trainer is set.

A :class:`Workload` names the latency distributions, failure mix and trainer knobs of one
scenario; :data:`PRESETS` are the benchmark's (the "Scheduler performance" issue's six
scheduling workloads, overhead and memory workloads) plus two for the autotuner: inference
contention and a rollout latency that doubles halfway through. :func:`scenarios` is the
scenario source every run draws from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from art_trio.sim.inference import LatencyShift
from art_trio.testing.distributions import Constant, Exponential, LatencyDist, LogNormal

__all__ = [
    "MEMORY_WORKLOADS",
    "OVERHEAD_WORKLOADS",
    "PRESETS",
    "SCHEDULING_WORKLOADS",
    "TUNING_WORKLOADS",
    "Workload",
    "scenarios",
]


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
    #: Requests the inference server serves at full speed; beyond it rollouts share it
    #: (processor sharing, :class:`~art_trio.sim.inference.ProcessorSharing`). None: no
    #: contention, every rollout takes its draw.
    inference_capacity: int | None = None
    #: Rollouts started after some train steps take a multiple of their draw.
    latency_shift: LatencyShift | None = None
    #: CPU seconds the trainer's process spends per rollout (start and end), on one core
    #: (:class:`~art_trio.sim.host.HostCPU`); 0: free, as virtual time makes it otherwise.
    rollout_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if self.workers <= 0 or self.min_batch <= 0 or self.max_batch < self.min_batch:
            raise ValueError(f"invalid workload {self.name!r}")
        if self.inference_capacity is not None and self.inference_capacity <= 0:
            raise ValueError("inference_capacity must be > 0 (or None)")
        if self.rollout_cpu_s < 0:
            raise ValueError("rollout_cpu_s must be >= 0")
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
            + (
                f"inference capacity {self.inference_capacity}, "
                if self.inference_capacity is not None
                else ""
            )
            + (f"{self.latency_shift.describe()}, " if self.latency_shift is not None else "")
            + (f"CPU {self.rollout_cpu_s * 1e6:g} us/rollout, " if self.rollout_cpu_s else "")
            + (f"{self.steps} steps" if self.steps is not None else f"{self.scenarios} scenarios")
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (distributions as their short description)."""
        data = asdict(self)
        data["rollout_latency"] = self.rollout_latency.describe()
        data["train_time"] = self.train_time.describe()
        if self.latency_shift is not None:
            data["latency_shift"] = self.latency_shift.describe()
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
#: on ART 0.5.18's asyncio trainer), the tuning workloads, then the overhead and memory ones.
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
        _scheduling(
            "contention",
            workers=64,
            rollout_latency=Exponential(0.05),
            inference_capacity=8,
            description=(
                "plenty-off1 on an inference server serving 8 rollouts at full speed, "
                "shared beyond that: workers past what keeps the trainer fed only queue there"
            ),
        ),
        _scheduling(
            "latency-doubles",
            steps=40,
            latency_shift=LatencyShift(after_steps=20, factor=2.0),
            description="plenty-off1 whose rollouts take twice as long from step 20 of 40 on",
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
#: Workloads whose best setting moves during the run or depends on the server (issue 17).
TUNING_WORKLOADS: tuple[str, ...] = ("contention", "latency-doubles")


def scenarios(count: int | None) -> Iterator[dict[str, Any]]:
    """Scenario dicts ``{"id": i, "metadata": {"scenario_id": i}}``; endless if ``count`` is None.

    The ``metadata.scenario_id`` form is what ART copies into ``group.metadata``; the rollout
    double sets it on the group itself too, so nothing depends on the trainer doing that.
    """
    i = 0
    while count is None or i < count:
        yield {"id": i, "metadata": {"scenario_id": i}}
        i += 1


