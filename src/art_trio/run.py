"""One `train()` call's shared state: what the stages read and write, and how a run stops.

A `PipelineRun` is built fresh by each `train()`, so two trainers (or two runs) share nothing.
Stages talk through channels; what is left here is what several stages must agree on: the
policy gate, the scenario ledger, the stop protocol and the counters.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
import art
import sniffio
from art import TrajectoryGroup

from .bridge import BaseExceptionEscaped, Bridge, await_callback, is_native, trio_native
from .compat import eval_lease, rollout_lease
from .executor import RolloutExecutor
from .gate import LoopEvent, PolicyGate
from .ledger import (
    SCENARIO_DIGESTS,
    ForeignStateError,
    PipelineState,
    StateStore,
    scenario_digest,
)
from .settings import PipelineSettings
from .status import StatusReporter

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Delivered:
    """A group on its way from a rollout worker to the trainer, with where it came from."""

    group: TrajectoryGroup
    scenario_index: int
    rollout_wall_s: float
    actor_idle_s: float
    #: The group's `initial_policy_version` (oldest of its trajectories), None if unversioned.
    version: int | None = None
    #: Its tokens' mean policy version, token-weighted (only with a mean-age bound set).
    mean_version: float | None = None


@dataclass(slots=True)
class RunCounters:
    """Where every scenario taken from the source ended up (property tests check the sum)."""

    taken: int = 0
    trained: int = 0
    stale: int = 0
    #: Of `stale`: rollouts the gate cancelled before they finished (doomed to be stale).
    stale_cancelled: int = 0
    zero_variance: int = 0
    #: Of `zero_variance`: groups with no trajectories at all (warned about).
    empty_groups: int = 0
    errored: int = 0
    dropped_at_stop: int = 0
    rollouts_started: int = 0
    #: Rollouts whose executor worker died; their scenarios were given back and taken again
    #: (each such take is not counted in `taken` twice).
    rollouts_lost: int = 0
    delivered: int = 0
    received: int = 0
    steps: int = 0
    evals_started: int = 0
    evals_finished: int = 0
    max_queued: int = 0
    # Seconds, summed over the run (the per-step train metrics log their increments):
    #: in rollouts that completed with a group, and idle in workers before each of them;
    rollout_s: float = 0.0
    rollout_idle_s: float = 0.0
    #: blocked handing a group over to a full channel;
    put_wait_s: float = 0.0
    #: in rollouts whose groups ended stale (discarded after completing), and in rollouts the
    #: gate cancelled as doomed.
    stale_rollout_s: float = 0.0
    cancelled_rollout_s: float = 0.0
    staleness: Counter[int] = field(default_factory=Counter)
    """Trained groups by how many versions behind the policy they were trained from.

    A histogram, not a list per group, so a run of a million groups costs no more memory."""


class TallyBase(NamedTuple):
    """ART 0.5.20's persisted tallies at the start of a run (groups, not rollouts)."""

    accepted: int
    stale: int
    zero_variance: int


def loop_clock() -> Callable[[], float]:
    """The running loop's clock function (trio's, virtual under MockClock; or asyncio's)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.current_time
    return asyncio.get_running_loop().time


def loop_event_factory() -> Callable[[], LoopEvent]:
    """The running loop's own event class (trio's or asyncio's).

    The gate parks a waiting worker on a fresh event about once per rollout; anyio.Event()
    looks the backend up and wraps the native event, which costs ~1 us more per rollout.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.Event
    return asyncio.Event


class _End:
    pass


_END = _End()


class ScenarioSource(Generic[T]):
    """Hands out scenarios with their index in the source, skipping resolved ones on resume.

    Sync iterables are read directly; async iterators are asyncio code unless marked
    `trio_native`, and are then pulled through the bridge. One taker at a time.

    The resolved prefix is skipped by the first `take()`, inside the rollout stage, so a
    stop is honoured while a slow or hanging source is being skipped: `close()` cancels a
    pull in progress (after a stop no scenario is needed any more). The first scenarios are
    checked against the fingerprints the stored state recorded (see `ledger.scenario_digest`)
    before any is handed out: a resumed run given another source is refused.
    """

    def __init__(
        self,
        scenarios: Iterable[T] | AsyncIterator[T],
        state: PipelineState,
        bridge: Bridge,
        *,
        state_file: str = "the stored state",
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
        self._stored_digests = list(state.scenario_digests)
        self._state_file = state_file
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
        self._state.total_scenarios_consumed -= 1

    async def take(self) -> tuple[int, T] | None:
        """The next unresolved scenario and its index, or None once exhausted or closed."""
        if self._returned and not self.closed:
            index, scenario = self._returned.popleft()
            self._state.total_scenarios_consumed += 1
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
                raise BaseExceptionEscaped(exc) from exc
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
                print(
                    "Warning: scenario iterator exhausted early while skipping "
                    f"(skipped {index}/{self._skip_target})."
                )
            return None
        if index < SCENARIO_DIGESTS:
            self._check_digest(index, item)
        self._next_index += 1
        if self._state.ledger.is_resolved(index):
            return None
        self._state.total_scenarios_consumed += 1
        return index, item

    def _check_digest(self, index: int, item: T) -> None:
        """Refuse a source whose first scenarios differ from the stored state's; record them."""
        digest = scenario_digest(item)
        stored = self._stored_digests
        if index < len(stored):
            if stored[index] is not None and digest is not None and stored[index] != digest:
                raise ForeignStateError(
                    f"scenario {index} of this run's source differs from scenario {index} of "
                    f"the run whose state is in {self._state_file}: a resumed run must be given "
                    "the same scenarios in the same order, or it skips and repeats the wrong "
                    "ones. Pass the same source, or train with resume=False to start over (if "
                    "the scenarios are the same and only their JSON form changed, delete the "
                    "`scenario_digests` key from that file)."
                )
            return
        digests = self._state.scenario_digests
        if index == len(digests):
            digests.append(digest)
            self._state.digests_unjournaled = True

    @property
    def position(self) -> int:
        """How many scenarios have been read from the source (taken or skipped)."""
        return self._next_index

    def close(self) -> None:
        self.closed = True
        if self._pull_scope is not None:
            self._pull_scope.cancel()


class PipelineRun:
    """State shared by the stages of one `train()` call."""

    def __init__(
        self,
        *,
        model: art.TrainableModel,
        backend: Any,
        settings: PipelineSettings,
        bridge: Bridge,
        state: PipelineState,
        store: StateStore,
        status: StatusReporter,
        start_step: int,
        source: ScenarioSource[Any],
        rollout_fn: Any,
        eval_fn: Any,
        config: Any,
        executor: RolloutExecutor | None = None,
    ) -> None:
        self.model = model
        #: Where rollouts run; None runs `rollout_fn` directly (no executor frame per rollout).
        self.executor = executor
        self.backend = backend
        # The backend's leases on a step's weights, as the installed ART line uses them.
        self.rollout_lease = rollout_lease(backend)
        self.eval_lease = eval_lease(backend)
        self.rollout_fn = rollout_fn
        self.eval_fn = eval_fn
        self.config = config
        self.settings = settings
        self.bridge = bridge
        self.state = state
        self.store = store
        self.status = status
        self.start_step = start_step
        self.source = source
        self.counters = RunCounters()
        self.freshness = settings.freshness
        # The loop's own clock: anyio.current_time() looks the backend up on every call, and
        # the stages read the time several times per rollout.
        self._clock = loop_clock()
        self.gate = PolicyGate(
            start_step=start_step,
            max_steps_off_policy=self.freshness.window,
            max_batch_size=settings.max_batch_size,
            admission=settings.admission,
            beyond_bound=settings.rollouts_beyond_bound,
            clock=self._clock,
            new_event=loop_event_factory(),
        )
        #: Scenarios whose rollouts failed since the last one that did not (left unresolved
        #: until a success shows the failures were the scenarios' and not the setup's).
        self.failure_streak: list[int] = []
        #: Usable groups received from the channel, waiting for a batch (see collect_batch).
        self.ready: list[Delivered] = []
        #: Zero-variance groups held since the last step (logged as split "discarded").
        self.held_zero_variance: list[TrajectoryGroup] = []
        self.held_zero_variance_total = 0
        self.collapsed = False
        #: Eval steps requested but not finished (their checkpoints must not be deleted).
        self.scheduled_eval_steps: set[int] = state.pending_eval_steps
        #: Steps a running rollout or eval samples from, with how many hold each.
        self.leased_steps: dict[int, int] = {}
        #: The persisted tallies as this run found them: earlier runs' share of the totals.
        self.tally_base = TallyBase(
            state.accepted_trainable_groups,
            state.discarded_stale_groups,
            state.discarded_zero_variance_groups,
        )
        #: How often each scenario's rollout was lost so far (see stages/rollout.py).
        self.lost_rollouts: dict[int, int] = {}
        #: ART 0.5.20's objective-score references (groups per step, rollouts per group).
        self.score_references: tuple[float | None, float | None] = (8.0, None)

        # The stop protocol. `stop_requested` is set once: by request_stop(), a signal, or
        # the training stage when it ends on its own. `graceful` decides whether in-flight
        # rollouts and a running eval get `shutdown_grace_seconds` before being cancelled.
        self.stop_requested = anyio.Event()
        self.graceful = True
        self.rollouts_done = anyio.Event()
        self.eval_idle = anyio.Event()
        self.eval_idle.set()
        self.finished = anyio.Event()
        self.collect_scope: anyio.CancelScope | None = None
        self.rollout_scope = anyio.CancelScope()
        self.eval_scope: anyio.CancelScope | None = None
        self.run_scope: anyio.CancelScope | None = None
        self._stages_left = {"rollout", "training", "eval"}

    # -- stopping ------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def request_stop(self, *, graceful: bool = True) -> None:
        """Stop taking scenarios; let in-flight work finish within the grace period."""
        if not self.stopping:
            self.graceful = graceful
            self.stop_requested.set()
        self.gate.close()
        self.source.close()
        if self.collect_scope is not None:
            self.collect_scope.cancel()

    def end_rollouts_now(self) -> None:
        """The run ended on its own: admit nothing more and cancel rollouts in flight."""
        self.gate.close()
        self.source.close()
        self.rollout_scope.cancel()

    def cancel_everything(self) -> None:
        """The second signal: cancel every stage now (state is still persisted)."""
        self.request_stop(graceful=False)
        if self.run_scope is not None:
            self.run_scope.cancel()

    @property
    def grace_seconds(self) -> float:
        if not self.graceful:
            return 0.0
        grace = self.settings.shutdown_grace_seconds
        return math.inf if grace is None else grace

    def stage_done(self, name: str) -> None:
        self._stages_left.discard(name)
        if not self._stages_left:
            self.finished.set()

    # -- leases ---------------------------------------------------------------------------

    async def call_leased(
        self,
        step: int,
        fn: Callable[..., Awaitable[R]],
        *args: Any,
        lease: Callable[[Any, int], AbstractAsyncContextManager[Any]] | None,
    ) -> R:
        """Await the user callback `fn(*args)` while holding a lease on `step`'s weights.

        Retention never deletes a leased checkpoint. `lease(model, step)` is the backend's
        lease (`adapter_lease` for rollouts; for evals on ART 0.5.20+ `exact_adapter_lease`
        where the backend has it, see compat.py), held for the callback's whole duration.
        For asyncio callbacks the lease is entered in the asyncio task that runs the callback,
        as ART does, so what it sets in context reaches the callback (LocalBackend pins the
        step `model.get_inference_name()` answers with) and is reset in the task that set it.
        """
        self.leased_steps[step] = self.leased_steps.get(step, 0) + 1
        try:
            if lease is None:
                return await self.bridge.callback(fn, *args)
            if is_native(fn) and self.bridge.uses_trio_asyncio:
                return await self._call_native_leased(lease, step, fn, *args)

            async def leased() -> R:
                async with lease(self.model, step):
                    return await await_callback(fn, *args)

            return await self.bridge.call(leased)
        finally:
            self.leased_steps[step] -= 1
            if self.leased_steps[step] <= 0:
                del self.leased_steps[step]

    async def _call_native_leased(
        self,
        lease: Callable[[Any, int], AbstractAsyncContextManager[Any]],
        step: int,
        fn: Callable[..., Awaitable[R]],
        *args: Any,
    ) -> R:
        # A trio-native callback cannot run inside an asyncio task, so the (asyncio) lease is
        # held by an asyncio task of its own for the callback's duration, entered and left in
        # that one task. Context it sets does not reach trio code.
        entered = anyio.Event()
        failed: list[BaseException] = []

        async def hold() -> None:
            async with lease(self.model, step):
                entered.set()
                await anyio.sleep_forever()

        async def holder() -> None:
            try:
                await self.bridge.call(hold)
            except Exception as exc:
                failed.append(exc)
                entered.set()

        outcome: list[R] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await entered.wait()
            try:
                if not failed:
                    outcome.append(await await_callback(fn, *args))
            except Exception as exc:
                failed.append(exc)
            finally:
                tg.cancel_scope.cancel()
        # Raised here, outside the task group, so callers see the callback's own exception.
        if failed:
            raise failed[0]
        return outcome[0]

    # -- persistence ---------------------------------------------------------------------

    def stale_for(self, step: int) -> Callable[[Delivered], bool]:
        """Whether a group is too old for the batch trained from `step`."""
        fresh = self.freshness
        return lambda item: fresh.is_stale(item.version, item.mean_version, step)

    def sync_tallies(self) -> None:
        """Carry this run's counts into ART 0.5.20's persisted tallies (after each step)."""
        base, counters, state = self.tally_base, self.counters, self.state
        state.accepted_trainable_groups = base.accepted + counters.trained
        state.discarded_stale_groups = base.stale + counters.stale - counters.stale_cancelled
        state.discarded_zero_variance_groups = base.zero_variance + counters.zero_variance

    def persist(self) -> None:
        """Record the state's changes in the journal (cheap: one append; see ledger.py)."""
        self.sync_tallies()
        self.store.append(self.state)

    def snapshot(self) -> None:
        """Write the whole state atomically (start and end of a run)."""
        self.sync_tallies()
        self.store.write(self.state)

    def now(self) -> float:
        return self._clock()


__all__ = ["Delivered", "PipelineRun", "RunCounters", "ScenarioSource"]
