"""The scenario source: hands out scenarios with their index, skipping settled ones on resume."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Generic, TypeVar

import anyio

from ..messages.errors import _BaseExceptionEscaped
from .bridge.calls import Bridge, is_native, trio_native
from .progress import RunProgress

T = TypeVar("T")
logger = logging.getLogger("art_trio")


class _End:
    pass


_END = _End()


class ScenarioSource(Generic[T]):
    """Hands out scenarios with their index in the source, skipping resolved ones on resume.

    Sync iterables are read directly; async iterators are asyncio code unless marked
    `trio_native`, and are then pulled through the bridge. One taker at a time.

    The settled prefix is skipped by the first `take()`, inside the rollout stage, so a
    stop is honoured while a slow or hanging source is being skipped: `close()` cancels a
    pull in progress (after a stop no scenario is needed any more). The first scenarios go
    to `RunProgress.check_scenario` before any is handed out (a durable store refuses a
    resumed run given another source).
    """

    def __init__(
        self,
        scenarios: Iterable[T] | AsyncIterator[T],
        state: RunProgress,
        bridge: Bridge,
    ) -> None:
        self._sync: Iterator[T] | None = None
        self._async: AsyncIterator[T] | None = None
        if isinstance(scenarios, AsyncIterator):
            self._async = scenarios
        else:
            self._sync = iter(scenarios)
        self._state = state
        self._bridge = bridge
        self._lock = anyio.Lock()
        self._next_index = 0
        # Scenarios whose rollout was lost (a dead executor worker), to be taken first.
        self._returned: deque[tuple[int, T]] = deque()
        self._skip_target = state.ledger.watermark
        self._checked = state.checked_scenarios
        self._pull_scope: anyio.CancelScope | None = None
        self.exhausted = False
        self.closed = False

    async def _pull(self) -> T | _End:
        if self._sync is not None:
            return next(self._sync, _END)
        assert self._async is not None
        iterator = self._async

        async def pull() -> T | _End:
            try:
                return await iterator.__anext__()
            except StopAsyncIteration:
                return _END

        if is_native(iterator):
            return await self._bridge.callback(trio_native(pull))
        return await self._bridge.call(pull)

    def give_back(self, index: int, scenario: T) -> None:
        """Return a taken scenario whose rollout was lost: the next `take` hands it out again."""
        self._returned.append((index, scenario))
        self._state.scenario_taken(-1)

    async def take(self) -> tuple[int, T] | None:
        """The next unresolved scenario and its index, or None once exhausted or closed."""
        if self._returned and not self.closed:
            index, scenario = self._returned.popleft()
            self._state.scenario_taken()
            return index, scenario
        if self._sync is not None:
            # Reading a plain iterable never awaits, so takers cannot interleave: no lock
            # (with thousands of workers admitted at once, queueing on it was measurable).
            return self._take_sync(self._sync)
        async with self._lock:
            with anyio.CancelScope() as scope:
                # close() cancels it: after a stop nothing waits for the source.
                self._pull_scope = scope
                if self.closed:
                    scope.cancel()
                try:
                    while not (self.exhausted or self.closed):
                        taken = self._number(await self._pull())
                        if taken is not None:
                            return taken
                finally:
                    self._pull_scope = None
            return None

    def _take_sync(self, iterator: Iterator[T]) -> tuple[int, T] | None:
        while not (self.exhausted or self.closed):
            try:
                item = next(iterator, _END)
            except (KeyboardInterrupt, SystemExit) as exc:
                # As from any callback: end the run cleanly, then re-raise (see bridge.py).
                raise _BaseExceptionEscaped(exc) from exc
            taken = self._number(item)
            if taken is not None:
                return taken
        return None

    def _number(self, item: T | _End) -> tuple[int, T] | None:
        """Give a pulled item its index; None if it ends the source or is already resolved."""
        index = self._next_index
        if isinstance(item, _End):
            self.exhausted = True
            if index < self._skip_target:
                logger.warning(
                    "scenario iterator exhausted early while skipping (skipped %d/%d)",
                    index,
                    self._skip_target,
                )
            return None
        if index < self._checked:
            self._state.check_scenario(index, item)
        self._next_index += 1
        if self._state.ledger.is_resolved(index):
            return None
        self._state.scenario_taken()
        return index, item

    @property
    def position(self) -> int:
        """How many scenarios have been read from the source (taken or skipped)."""
        return self._next_index

    def close(self) -> None:
        self.closed = True
        if self._pull_scope is not None:
            self._pull_scope.cancel()
