"""Workloads, doubles and measures for benchmarking and simulating pipeline trainers.

- :mod:`~art_trio.testing.distributions`: latency distributions, drawn reproducibly by index;
- :mod:`~art_trio.sim.workloads`: :class:`Workload` and the benchmark's presets;
- :mod:`~art_trio.sim.inference`: inference contention and latency shifts;
- :mod:`~art_trio.sim.recorder`: what the doubles saw during a run;
- :mod:`~art_trio.sim.doubles`: the workload's backend, rollout and eval doubles (on
  :mod:`art_trio.testing`);
- :mod:`~art_trio.sim.measures`: every reported measure, defined once.

Everything these modules await is anyio, so the same doubles run under ART's asyncio
``PipelineTrainer``, under art_trio on trio or asyncio, and under trio's ``MockClock`` (virtual
time). They import nothing from art_trio but :mod:`art_trio.testing`: the benchmark's ART child
process relies on that. The simulator is ``art_trio.sim.simulate``.
"""

from art_trio.sim.doubles import (
    RolloutFailed,
    SyntheticBackend,
    eval_double,
    make_eval_fn,
    make_rollout_fn,
)
from art_trio.sim.inference import LatencyShift, ProcessorSharing
from art_trio.sim.measures import RunReport, format_staleness, measure
from art_trio.sim.recorder import Recorder, StepRecord, current_rss_bytes, peak_rss_bytes
from art_trio.sim.workloads import (
    MEMORY_WORKLOADS,
    OVERHEAD_WORKLOADS,
    PRESETS,
    SCHEDULING_WORKLOADS,
    TUNING_WORKLOADS,
    Workload,
    scenarios,
)
from art_trio.testing.distributions import (
    Constant,
    Empirical,
    Exponential,
    IndexedDraws,
    LatencyDist,
    LogNormal,
)

__all__ = [
    "MEMORY_WORKLOADS",
    "OVERHEAD_WORKLOADS",
    "PRESETS",
    "SCHEDULING_WORKLOADS",
    "TUNING_WORKLOADS",
    "Constant",
    "Empirical",
    "Exponential",
    "IndexedDraws",
    "LatencyDist",
    "LatencyShift",
    "LogNormal",
    "ProcessorSharing",
    "Recorder",
    "RolloutFailed",
    "RunReport",
    "StepRecord",
    "SyntheticBackend",
    "Workload",
    "current_rss_bytes",
    "eval_double",
    "format_staleness",
    "make_eval_fn",
    "make_rollout_fn",
    "measure",
    "peak_rss_bytes",
    "scenarios",
]
