"""Where rollouts run, when not in the trainer's own task: implementations of the executor
protocol the kernel defines (`art_trio.plumbing.executor.RolloutExecutor`, ART 0.5.20's).

`InProcessExecutor` runs the rollout in the trainer's process (the protocol's reference
implementation); `RayRolloutExecutor` runs it on a pool of Ray actors (extra `ray`; imported
on first use so that `import art_trio.executors` does not import ray).
"""

from __future__ import annotations

from typing import Any

from ..plumbing.executor import RolloutExecutor
from .in_process import InProcessExecutor

__all__ = ["InProcessExecutor", "RolloutExecutor", "RayRolloutExecutor"]


def __getattr__(name: str) -> Any:
    if name == "RayRolloutExecutor":
        from .ray import RayRolloutExecutor

        return RayRolloutExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
