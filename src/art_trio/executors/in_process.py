"""`InProcessExecutor`: the executor protocol run in the trainer's own process and loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class InProcessExecutor:
    """Runs the rollout in the trainer's own process and asyncio loop: the trainer's default."""

    @property
    def max_workers(self) -> int | None:
        return None

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
