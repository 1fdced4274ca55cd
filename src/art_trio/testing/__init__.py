"""Test doubles shared by art_trio's tests, property harness, simulator and benchmark.

See :mod:`art_trio.testing.doubles`. Imports nothing from the rest of art_trio, so the
benchmark's ART child process can load it without art_trio's ``__init__`` (trio-asyncio).
"""

from art_trio.testing.doubles import (
    BackendDouble,
    EvalCall,
    EvalDouble,
    Flavor,
    TrainBatch,
    clock_for,
    group_initial_version,
    trajectory,
    trajectory_group,
)

__all__ = [
    "BackendDouble",
    "EvalCall",
    "EvalDouble",
    "Flavor",
    "TrainBatch",
    "clock_for",
    "group_initial_version",
    "trajectory",
    "trajectory_group",
]
