"""Where a rollout runs: the executor protocol the trainer calls (implementations live in
`art_trio.executors`; with no executor the trainer calls the rollout function itself).

The protocol is ART 0.5.20's `art.distributed.rollout.RolloutExecutor`, same names, so an
executor written for ART's trainer fits here. `run` is asyncio code: the trainer awaits it
through its asyncio bridge, inside an asyncio task. Cancelling that task must cancel the work
wherever it runs and re-raise `asyncio.CancelledError` promptly. A worker that dies under a
rollout raises `RolloutLost`; any other failure raises the rollout's own exception.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RolloutExecutor(Protocol):
    """Runs one rollout for the trainer's rollout worker `worker_id` (ART 0.5.20's protocol)."""

    @property
    def max_workers(self) -> int | None:
        """The most rollout workers this executor can serve at once, or None for no limit."""
        ...

    def set_target(self, target_workers: int) -> None:
        """The trainer means to run `target_workers` rollout workers."""
        ...

    def set_workers(self, worker_ids: tuple[int, ...]) -> None:
        """The ids of the trainer's rollout workers from now on."""
        ...

    async def run(
        self,
        worker_id: int,
        rollout_fn: Callable[..., Awaitable[Any]],
        model: Any,
        scenario: Any,
        config: Any,
    ) -> Any:
        """`await rollout_fn(model, scenario, config)`, wherever this executor runs it."""
        ...
