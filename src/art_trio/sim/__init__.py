"""Workload doubles for benchmarking and simulating pipeline trainers.

Everything here awaits only anyio primitives (``anyio.sleep``, ``anyio.current_time``), so the
same doubles run under ART's asyncio ``PipelineTrainer``, under art_trio on trio or asyncio,
and under trio's ``MockClock`` (virtual time). This package imports nothing else from art_trio:
the benchmark's ART child process relies on that. The simulator is ``art_trio.sim.simulate``.
"""

from art_trio.sim import workload
from art_trio.sim.workload import *  # noqa: F403  (the workload module's public names)

__all__ = list(workload.__all__)
