"""The backend's `adapter_retention_lease` on each step awaiting its eval (ART 0.5.20+).

ART 0.5.23's trainer takes `backend.adapter_retention_lease(model, step)` when it schedules an
eval of `step` and keeps it until that eval has ended (or the run ends first): the backend
then keeps that step's adapter loaded for the eval to come (a Megatron backend prunes the
adapters nobody holds). art_trio does the same, where the backend has the method.

The lease is asyncio code entered once and left much later, from other tasks: each one is
held by a task of its own (the run's task group), whose asyncio side enters the lease and
waits until `release` cancels it. Retention's own protection of a step awaiting eval
(`pending_eval_steps`) does not depend on this.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import TaskGroup

from .bridge import Bridge
from .hooks import backend_hook


class EvalRetentionLeases:
    """One `adapter_retention_lease` per step awaiting eval, taken once, released once."""

    def __init__(self, backend: object, model: Any, bridge: Bridge) -> None:
        self._lease = backend_hook(backend, "adapter_retention_lease")
        self._model = model
        self._bridge = bridge
        self._group: TaskGroup | None = None
        #: Step -> (the holder's cancel scope, set when the holder has left the lease).
        self._held: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}

    def attach(self, group: TaskGroup) -> None:
        """Hold leases in `group` (the run's task group) from now on."""
        self._group = group

    async def take(self, step: int) -> None:
        """Enter the lease on `step` (once: a step already held is left as it is).

        Returns once the backend granted it; its error, if it refuses, is raised here.
        """
        if self._lease is None or self._group is None or step in self._held:
            return
        scope, left = anyio.CancelScope(), anyio.Event()
        entered = anyio.Event()
        failed: list[BaseException] = []
        lease, model = self._lease, self._model

        async def keep() -> None:
            async with lease(model, step):
                entered.set()
                await anyio.sleep_forever()

        async def holder() -> None:
            try:
                with scope:
                    await self._bridge.call(keep)
            except Exception as exc:
                failed.append(exc)
            finally:
                entered.set()
                left.set()

        self._held[step] = (scope, left)
        self._group.start_soon(holder)
        await entered.wait()
        if failed:
            del self._held[step]
            raise failed[0]

    async def release(self, step: int) -> None:
        """Leave the lease on `step` (if held) and wait until the backend has it back."""
        held = self._held.pop(step, None)
        if held is None:
            return
        scope, left = held
        scope.cancel()
        with anyio.CancelScope(shield=True):
            await left.wait()

    async def release_all(self) -> None:
        for step in sorted(self._held):
            await self.release(step)


__all__ = ["EvalRetentionLeases"]
