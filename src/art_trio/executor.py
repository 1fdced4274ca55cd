"""Where a rollout runs: ART 0.5.20's `RolloutExecutor` protocol, and what a lost rollout is.

The trainer keeps admission, batching and the ledger; an executor only decides where
`rollout_fn(model, scenario, config)` runs (this process, a Ray cluster, ...). Its `run` is
asyncio code, awaited through the bridge inside an asyncio task, so:

- cancelling that task (a doomed rollout, a stop past its grace) must cancel the remote work
  and re-raise `asyncio.CancelledError` promptly, leaving nothing running;
- a worker that dies mid-rollout raises `RolloutLost`: the trainer gives the scenario back
  and rolls it again (neither an error nor resolved), so nothing is lost or trained twice;
- any other failure is that rollout's error, as if `rollout_fn` had raised it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable


class RolloutLost(Exception):
    """The rollout's worker (process or node) died; the scenario was not rolled out.

    The trainer gives the scenario back to be rolled again: not an error, not resolved.
    """


@runtime_checkable
class RolloutExecutor(Protocol):
    """ART 0.5.20's rollout executor protocol (`art.distributed.rollout.RolloutExecutor`)."""

    @property
    def max_workers(self) -> int | None:
        """How many rollouts it can run at once (None: no limit)."""
        ...

    def set_target(self, target_workers: int) -> None:
        """How many rollout workers the trainer will run."""
        ...

    def set_workers(self, worker_ids: tuple[int, ...]) -> None:
        """The ids of the trainer's rollout workers (passed back to `run`)."""
        ...

    async def run(
        self,
        worker_id: int,
        rollout_fn: Callable[..., Awaitable[Any]],
        model: Any,
        scenario: Any,
        config: Any,
    ) -> Any:
        """Run `rollout_fn(model, scenario, config)` and return its group."""
        ...


class InProcessExecutor:
    """Runs each rollout in the trainer's own process (what the trainer does by default)."""

    max_workers: int | None = None

    def set_target(self, target_workers: int) -> None:
        if target_workers < 1:
            raise ValueError("target_workers must be >= 1")

    def set_workers(self, worker_ids: tuple[int, ...]) -> None:
        del worker_ids

    async def run(
        self,
        worker_id: int,
        rollout_fn: Callable[..., Awaitable[Any]],
        model: Any,
        scenario: Any,
        config: Any,
    ) -> Any:
        del worker_id
        return await rollout_fn(model, scenario, config)


__all__ = ["InProcessExecutor", "RolloutExecutor", "RolloutLost"]
