"""The scenario source: hands out scenarios with their index, skipping settled ones on resume."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Generic, TypeVar

import anyio

from ..messages.errors import ScenarioSourceClosed, sync_callback_error
from .bridge.calls import Bridge, callable_name, is_native, trio_native
from .progress import RunProgress, ScenarioBook

T = TypeVar("T")
logger = logging.getLogger("art_trio")


class _End:
    pass


_END = _End()


class ScenarioCursor(Generic[T]):
    """The trainer's scenarios between its `train()` calls.

    A re-iterable source (a list, a range) is read from its start by every run, as a resumed
    process reads it, and the resume state skips what was resolved. A one-shot iterator (a
    generator, an async generator) cannot be read again, so a later `train()` of the same
    trainer (a supervisor's retry after `PipelineStalled`, a run continued after
    `request_stop()`) goes on where the last one left it, and first hands out again what that
    one took and did not resolve (in flight or queued when it ended). A new process passes a
    new iterator, read from its start.
    """

    def __init__(self, scenarios: Iterable[T] | AsyncIterator[T]) -> None:
        self.scenarios = scenarios
        self.one_shot = isinstance(scenarios, AsyncIterator) or iter(scenarios) is scenarios
        #: How many scenarios have been read from the source (taken or skipped as resolved),
        #: and whether to its end: this run's, or for a one-shot iterator every run's so far.
        self.read = 0
        self.exhausted = False
        #: What they took, by index, until seen resolved (pruned as the dict doubles).
        self.taken: dict[int, T] = {}
        #: An asyncio source's pull still running when the run that started it stopped: the
        #: next take awaits it rather than pull again (see `ScenarioSource._pull`).
        self.pull: asyncio.Future[T | _End] | None = None
        self._prune_at = 256
        self._ledger: ScenarioBook | None = None

    def start(self, ledger: ScenarioBook) -> list[tuple[int, T]]:
        """A run begins with `ledger`: what earlier runs took from a one-shot iterator and
        did not resolve, in order. Resolved means in the ledger the run that took it ended
        with, or in this one (with `resume=False` each run's ledger starts empty)."""
        last, self._ledger = self._ledger, ledger
        if not self.one_shot:  # read again from its start
            self.read, self.exhausted = 0, False
            return []
        self.check_open()
        if self.pull is not None and self.pull.cancelled():
            self.pull = None  # its loop closed under it (the last call's): pull afresh
        if not ledger.keeps_fates:  # (ART's rule: every scenario taken is settled)
            self.taken.clear()
            return []
        self.taken = {
            i: s for i, s in self.taken.items()
            if not ledger.is_resolved(i) and not (last is not None and last.is_resolved(i))
        }
        return sorted(self.taken.items(), key=lambda taken: taken[0])

    def took(self, index: int, scenario: T) -> None:
        if not self.one_shot or self._ledger is None or not self._ledger.keeps_fates:
            return
        self.taken[index] = scenario
        if len(self.taken) >= self._prune_at:
            ledger = self._ledger
            self.taken = {i: s for i, s in self.taken.items() if not ledger.is_resolved(i)}
            self._prune_at = max(256, 2 * len(self.taken))

    def check_open(self) -> None:
        """Refuse to go on from an async generator an asyncio loop closed midway: it would
        look exhausted, and the run would end early with the rest of its scenarios unread."""
        source = self.scenarios
        pull = self.pull
        if pull is not None and pull.done() and not pull.cancelled() and (
            pull.exception() is not None or pull.result() is _END
        ):
            return  # the source's end or error, pulled before it closed: the next take's
        # (A scenario pulled before it closed is not enough to go on from: after it the
        # closed generator would look exhausted.)
        if inspect.isasyncgen(source) and source.ag_frame is None and not self.exhausted:
            raise ScenarioSourceClosed(
                f"train() was called again on this trainer, but its scenarios' async "
                f"generator was closed after {self.read} scenarios: the last call's asyncio "
                "loop finalized it as it closed (an asyncio loop closes the async generators "
                "it ran). Give a new PipelineTrainer a new generator (the resume state skips "
                "what was resolved), or keep one asyncio loop around both calls so that it "
                "outlives them: under trio, `async with trio_asyncio.open_loop():`; under "
                "asyncio, both calls in one asyncio.run() or anyio.run()."
            )


class ScenarioSource(Generic[T]):
    """Hands out scenarios with their index in the source, skipping resolved ones on resume.

    Sync iterables are read directly; async iterators are asyncio code unless marked
    `trio_native`, and are then pulled through the bridge. One taker at a time.

    The settled prefix is skipped by the first `take()`, inside the rollout stage, so a
    stop is honoured while a slow or hanging source is being skipped: `close()` stops waiting
    for a pull in progress (after a stop no scenario is needed any more; an asyncio source's
    pull runs on, see `_pull`). The first scenarios go to `RunProgress.check_scenario` before
    any is handed out (a durable store refuses a resumed run given another source).
    """

    def __init__(self, cursor: ScenarioCursor[T], state: RunProgress, bridge: Bridge) -> None:
        scenarios = cursor.scenarios
        self._sync: Iterator[T] | None = None
        self._async: AsyncIterator[T] | None = None
        if isinstance(scenarios, AsyncIterator):
            self._async = scenarios
            self._source_name = f"the scenario source {callable_name(scenarios)}"
        else:
            self._sync = iter(scenarios)
        self._state = state
        self._bridge = bridge
        self._lock = anyio.Lock()
        # Scenarios to be taken first: whose rollout was lost (a dead executor worker), and
        # what an earlier run took from a one-shot iterator and did not resolve.
        self._returned: deque[tuple[int, T]] = deque()
        self._cursor = cursor
        self._returned.extend(cursor.start(state.ledger))
        self._skip_target = state.ledger.watermark
        self._checked = state.checked_scenarios
        self._pull_scope: anyio.CancelScope | None = None
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
        cursor = self._cursor

        async def pull_through_a_stop() -> T | _End:
            # In an asyncio task of its own, kept by the cursor until its scenario is
            # numbered: a stop that cancels this wait leaves the source alone (a generator
            # cancelled at an await is closed for good), and the next take, in this run or a
            # later train(), gets the scenario it pulls instead of pulling past it.
            if cursor.pull is None:
                cursor.pull = asyncio.ensure_future(pull())
            pulling = cursor.pull
            try:
                item = await asyncio.shield(pulling)
            except BaseException:
                # The source raised, or its loop closed: pull afresh. A pull that completed
                # as the stop came stays the next take's.
                if pulling.done() and (pulling.cancelled() or pulling.exception()):
                    cursor.pull = None
                raise
            cursor.pull = None
            return item

        # What an error about the pull names (asyncio code cancelling itself): the source.
        pull_through_a_stop.__qualname__ = self._source_name
        return await self._bridge.call(pull_through_a_stop)

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
                    while not (self._cursor.exhausted or self.closed):
                        taken = self._number(await self._pull())
                        if taken is not None:
                            return taken
                finally:
                    self._pull_scope = None
            return None

    def _take_sync(self, iterator: Iterator[T]) -> tuple[int, T] | None:
        while not (self._cursor.exhausted or self.closed):
            try:
                item = next(iterator, _END)
            except BaseException as raised:  # (a synchronous call: all of it is the source's)
                exc = sync_callback_error(raised, iterator)
                if exc is raised:
                    raise
                raise exc from raised
            taken = self._number(item)
            if taken is not None:
                return taken
        return None

    def _number(self, item: T | _End) -> tuple[int, T] | None:
        """Give a pulled item its index; None if it ends the source or is already resolved."""
        cursor = self._cursor
        index = cursor.read
        if isinstance(item, _End):
            cursor.exhausted = True
            if index < self._skip_target:
                logger.warning(
                    "scenario iterator exhausted early while skipping (skipped %d/%d)",
                    index,
                    self._skip_target,
                )
            return None
        if index < self._checked:
            self._state.check_scenario(index, item)
        cursor.read += 1  # (a scenario skipped as resolved was read too)
        if self._state.ledger.is_resolved(index):
            return None
        self._state.scenario_taken()
        cursor.took(index, item)
        return index, item

    @property
    def position(self) -> int:
        """How many scenarios have been read from the source (taken or skipped)."""
        return self._cursor.read

    def close(self) -> None:
        self.closed = True
        if self._pull_scope is not None:
            self._pull_scope.cancel()
