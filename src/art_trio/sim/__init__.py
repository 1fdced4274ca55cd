"""Workload doubles for benchmarking and simulating pipeline trainers.

Everything here awaits only anyio primitives (``anyio.sleep``, ``anyio.current_time``), so the
same doubles run under ART's asyncio ``PipelineTrainer``, under art_trio on trio or asyncio,
and under trio's ``MockClock`` (virtual time).
"""

from art_trio.sim.workload import (
    PRESETS,
    Constant,
    Empirical,
    Exponential,
    LatencyDist,
    LogNormal,
    Recorder,
    RolloutFailed,
    RunReport,
    StepRecord,
    SyntheticBackend,
    Workload,
    make_eval_fn,
    make_rollout_fn,
    measure,
    peak_rss_bytes,
    scenarios,
)

__all__ = [
    "PRESETS",
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
    "scenarios",
]
