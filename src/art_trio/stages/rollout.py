"""The rollout stage: rollout workers turning scenarios into groups.

A worker first waits at the policy gate, then takes a scenario (so no scenario sits in a
waiting worker's hands), runs the user's rollout, and hands the group to the trainer over the
bounded groups channel. A group already too old for any batch still to come is dropped right
there (if the admission policy evicts early) instead of occupying the channel. When every
worker has finished, the stage closes its side of the channel and the trainer sees the end.

The number of workers can change while the run goes (`resize`): new workers start in the
stage's own task group; a worker over the target leaves before it takes another scenario
(one waiting at the gate is sent away at once), so the rollout it holds finishes normally and
its scenario is never lost or trained twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from art import TrajectoryGroup

from ..messages.errors import (
    CallbackNotAwaitable,
    ExecutorUnavailable,
    RolloutLost,
    RolloutRejected,
    RolloutsKeepFailing,
    _BaseExceptionEscaped,
    _GateClosed,
)
from ..messages.events import (
    GroupQueued,
    HandOverBlocked,
    RolloutEnded,
    RolloutGivenBack,
    RolloutStarted,
)
from ..messages.values import Delivered, Fate, RolloutInFlight
from ..plumbing.compat import (
    FATAL_ROLLOUT_ERRORS,
    RECORDS_COMPLETION_TOKENS,
    record_completion_tokens,
)
from ..plumbing.group_queue import GroupSendEnd
from ..policy.batching import (
    copy_scenario_metadata,
    future_policy_error,
    newest_version,
    rollout_problem,
    scenario_context,
    stamp_policy_versions,
)
from ..policy.freshness import (
    mean_policy_version,
    newest_token_version,
    plain_tokens,
)
from ..run import PipelineRun

logger = logging.getLogger("art_trio")

#: Times one scenario's rollout may be lost (its executor worker dying) before the loss
#: counts as that rollout's error: a scenario that kills its worker must not loop forever.
MAX_LOSSES = 3


#: Exceptions from a rollout that end the run, not count as that rollout's failure: a
#: KeyboardInterrupt or SystemExit carried out of a callback, a rollout_fn that can never
#: work, and ART 0.5.20+'s LocalServingUnavailableError (its inference server is gone).
ENDS_THE_RUN: tuple[type[BaseException], ...] = (
    _BaseExceptionEscaped, CallbackNotAwaitable, ExecutorUnavailable, *FATAL_ROLLOUT_ERRORS,
)

#: What `_call_tracked` returns for a rollout the gate cancelled as doomed.
DOOMED = object()


class _Rolling:
    """What one worker rolls out now: made once per worker and overwritten per rollout, so
    the stall watchdog can name the rollouts in flight at no allocation per rollout."""

    __slots__ = ("index", "started")

    def __init__(self) -> None:
        #: The scenario index (-1: none, between rollouts) and when its rollout started.
        self.index = -1
        self.started = 0.0


@dataclass(eq=False)
class RolloutStage:
    """The workers, and what only they need: the failure streak and lost-rollout counts."""

    name = "rollout"

    run: PipelineRun

    def __post_init__(self) -> None:
        self._emit = self.run.emit
        #: The stage's end of the groups channel (each worker sends on a clone of it).
        self.send = self.run.groups.send_end
        #: Scenarios whose rollouts failed since the last one that did not (left unresolved
        #: until a success shows the failures were the scenarios' and not the setup's).
        self.failure_streak: list[int] = []
        #: How often each scenario's rollout was lost so far.
        self.lost_rollouts: dict[int, int] = {}
        self._workers: TaskGroup | None = None
        self._live = self.run.workers
        self.run.resize_workers = self.resize
        #: Each live worker's rollout now (see `_Rolling`).
        self._rolling: dict[int, _Rolling] = {}
        self._target = 0
        #: The next worker's id: ids are never reused, so one > 0 means workers were started.
        self._next_id = 0

    async def __call__(self) -> None:
        try:
            with self.run.stop.rollout_scope:
                async with self.send, anyio.create_task_group() as workers:
                    self._workers = workers
                    self.resize(self.run.settings.sizes.num_rollout_workers)
        finally:
            self._workers = None
            self.run.stop.rollouts_done.set()
            self.run.stop.stage_done("rollout")

    # -- sizing ---------------------------------------------------------------------------

    def resize(self, workers: int) -> None:
        """Run `workers` workers from now on: start new ones, or let the extra ones leave."""
        self._target = workers
        if self._workers is None or self.run.gate.closed:
            # The stage has ended, or is ending (a closed gate admits no one): a new worker
            # would leave at once, and the task group may already be closed to new tasks.
            return
        while len(self._live) < workers:
            if not self._live and self._next_id > 0:
                return  # every worker has left: the task group is closing
            worker_id = self._next_id
            self._next_id += 1
            self._live.add(worker_id)
            self._workers.start_soon(
                self._worker, worker_id, self.send.clone(), name=f"rollout worker {worker_id}"
            )
        extra = len(self._live) - workers
        if extra > 0:
            # Waiting at the gate: sent away now. Busy ones leave after their rollout.
            self.run.gate.dismiss(extra)
        executor = self.run.executor
        if executor is not None:
            # The one place the executor learns the worker count (at start and on a resize).
            executor.set_target(workers)
            executor.set_workers(tuple(sorted(self._live)))

    def in_flight(self, now: float) -> tuple[RolloutInFlight, ...]:
        """The rollouts running now, oldest first: scenario index, age, worker."""
        found = [
            RolloutInFlight(slot.index, now - slot.started, worker)
            for worker, slot in list(self._rolling.items())
            if slot.index >= 0
        ]
        return tuple(sorted(found, key=lambda r: -r.age_s))

    def _leaving(self) -> bool:
        return len(self._live) > self._target

    async def _worker(self, worker_id: int, send: GroupSendEnd[Delivered]) -> None:
        self._rolling[worker_id] = _Rolling()
        try:
            async with send:
                while True:
                    # One cancel scope carries this worker's rollouts until the gate cancels
                    # one that no batch can train any more; only then is a new one opened.
                    # Entering a scope costs 3 to 6 us, too much to pay per rollout when
                    # rollouts are fast. The gate cancels the scope only while a rollout is
                    # tracked in it (see `_roll`), so the cancellation never lands in the
                    # gate, the source or the hand-over.
                    with anyio.CancelScope() as doom_scope:
                        await self._serve(worker_id, send, doom_scope)
                    if not doom_scope.cancel_called:
                        return
                    # A doomed rollout (settled by `_roll`) ended the scope.
        except Exception as exc:
            # The run's first error, before the other workers are cancelled and settle what
            # they hold (an observer raising then must not replace it).
            self.run.observers.note_failure(exc)
            raise
        finally:
            self._live.discard(worker_id)
            self._rolling.pop(worker_id, None)

    async def _serve(
        self,
        worker_id: int,
        send: GroupSendEnd[Delivered],
        doom_scope: anyio.CancelScope,
    ) -> None:
        """Admit, roll out and hand over until the run ends, the worker is retired, or the
        gate dooms a rollout."""
        run = self.run
        gate = run.gate
        # When this worker's previous rollout ended: from then until the next starts it is
        # idle (handing the group over, waiting at the gate), which each step reports.
        idle_since = run.now()
        while not self._leaving():
            try:
                version = await gate.admit()
            except _GateClosed:
                if gate.closed:
                    return
                continue  # sent away by a resize: leave if still over the target
            try:
                taken = None if run.stop.stopping else await run.source.take()
            except BaseException:
                gate.rollout_done(version)
                raise
            if taken is None:
                gate.rollout_done(version)
                return
            item = await self._roll(worker_id, version, taken, idle_since, doom_scope)
            idle_since = run.now()
            if item is None:
                if doom_scope.cancel_called:
                    return  # leave the cancelled scope before anything awaits in it
                continue
            if not await self._hand_over(item, version, send):
                return

    async def _hand_over(
        self, item: Delivered, version: int, send: GroupSendEnd[Delivered]
    ) -> bool:
        """Put a group in the channel to the trainer; False once the trainer stopped taking."""
        gate = self.run.gate
        gate.hand_over(version)
        self._emit(GroupQueued(item.scenario_index, gate.queued))
        try:
            try:
                # Waits only when the channel is full: the worker yields at the gate next
                # (a second trip through the scheduler per rollout costs ~3 us under trio).
                send.send_nowait(item)
            except anyio.WouldBlock:
                blocked = self.run.now()
                await send.send(item)
                self._emit(HandOverBlocked(self.run.now() - blocked))
        except BaseException as exc:
            # Stopped or ended while handing over: neither trained nor resolved, so a
            # resumed run rolls this scenario again (and it leaves the gate's queue).
            self.run.fates.settle(Fate.DROPPED_AT_STOP, item.scenario_index, queued=True)
            if isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError)):
                return False  # the trainer stopped receiving
            raise
        return True

    async def _roll(
        self,
        worker_id: int,
        version: int,
        taken: tuple[int, Any],
        idle_since: float,
        doom_scope: anyio.CancelScope,
    ) -> Delivered | None:
        """Roll one scenario out: its group to deliver, or None once its fate is settled.

        Owns the in-flight slot `version` until it returns a group (the hand-over then
        takes it over). The rollout runs tracked in the worker's `doom_scope`, which the gate
        cancels once no batch still to be taken could train it; the rollout then ends
        DOOMED (`_call_tracked`) and the worker leaves the cancelled scope for a new one.
        """
        run = self.run
        gate = run.gate
        index, scenario = taken
        self._emit(RolloutStarted(index))
        started = run.now()
        rolling = self._rolling[worker_id]
        rolling.index, rolling.started = index, started
        handed = False
        # Seconds of a rollout that completed with a group, and idle before it.
        completed_s = idle_s = 0.0
        try:
            group = await self._call_tracked(worker_id, version, scenario, doom_scope)
            wall = run.now() - started
            if group is DOOMED:
                # A censored latency sample (cancelled rollouts are the slow ones), then its
                # fate; the worker leaves its cancelled scope next.
                gate.note_rollout_time(wall, completed=False)
                run.fates.settle(Fate.CANCELLED_STALE, index, rollout_s=wall)
                return None
            gate.note_rollout_time(wall, completed=True)
            if isinstance(group, Exception):
                self._failed(worker_id, index, scenario, group)
                return None
            if run.stop.stopping:
                # Finished after the stop: not trained and not resolved, so a resumed run
                # rolls it again.
                run.fates.settle(Fate.DROPPED_AT_STOP, index, rollout_s=wall)
                return None
            completed_s, idle_s = wall, started - idle_since
            item = self._delivery(index, scenario, group, version, wall, idle_s)
            handed = item is not None
            return item
        except (anyio.get_cancelled_exc_class(), *ENDS_THE_RUN):
            # Stopped or ended; or a KeyboardInterrupt or SystemExit, a rollout_fn that can
            # never work, an executor that cannot run anything, or ART's local inference gone
            # (LocalServingUnavailableError, 0.5.20+): not this scenario's failure. Neither
            # trained nor resolved: a resumed run rolls it again.
            run.fates.settle(Fate.DROPPED_AT_STOP, index)
            raise
        except RolloutLost as exc:
            if not self._give_back(index, scenario):
                self._failed(worker_id, index, scenario, exc)
            return None
        finally:
            rolling.index = -1
            if not handed:
                gate.rollout_done(version)
            self._emit(RolloutEnded(index, run.now() - started, completed_s, idle_s))

    async def _call_tracked(
        self, worker_id: int, version: int, scenario: Any, doom_scope: anyio.CancelScope
    ) -> Any:
        """The rollout's group, the exception it failed with, or DOOMED if the gate doomed
        it (whatever it made of its cancellation)."""
        run = self.run
        gate = run.gate
        gate.track(version, doom_scope)
        try:
            # (The call is made here, not in a helper coroutine: every frame between the
            # worker and the rollout is resumed each time the rollout yields.)
            token = run.model.activate_metrics_context("train")
            try:
                # Leased for the whole call: the rollout samples from `version`'s weights. An
                # executor is called with the worker's id before the rollout function's own
                # arguments (`RolloutExecutor.run`).
                rollout = (run.rollout_fn,) if run.executor is None else (
                    run.executor.run, worker_id, run.rollout_fn
                )
                group = await run.leases.call(
                    version, *rollout, run.model, scenario, run.config, lease=run.rollout_lease
                )
            finally:
                token.var.reset(token)
        except ENDS_THE_RUN + (RolloutLost,):
            raise
        except Exception as exc:
            return DOOMED if doom_scope.cancel_called else exc
        except anyio.get_cancelled_exc_class():
            if doom_scope.cancel_called:
                return DOOMED  # the gate's cancellation, which ends here
            raise
        finally:
            gate.untrack(version, doom_scope)
        if doom_scope.cancel_called:
            return DOOMED  # doomed after its last checkpoint: no batch can use its result
        try:
            _check_rollout_result(group)
        except RolloutRejected as exc:
            return exc
        return group

    def _delivery(
        self,
        index: int,
        scenario: Any,
        group: TrajectoryGroup,
        version: int,
        wall: float,
        idle_s: float,
    ) -> Delivered | None:
        """The completed group as it goes to the trainer; None if it settled here."""
        run = self.run
        # A rollout got through: the failures before it were the scenarios' own.
        run.state.ledger.resolve_all(self.failure_streak)
        self.failure_streak.clear()
        copy_scenario_metadata(group, scenario)
        # As ART 0.5.20+'s workers do, so the trajectories logged and sent to the backend
        # (held zero-variance groups too) carry their serving usage.
        if RECORDS_COMPLETION_TOKENS:
            for trajectory in group.trajectories:
                record_completion_tokens(trajectory)
        group_version = stamp_policy_versions(
            group, initial=version, final=run.gate.policy_version
        )
        mean_bound = run.freshness.limit_mean_steps_off_policy is not None
        # Checked before either bound: a version ahead of the trainer's would count as fresh
        # (a negative age). Policy versions only grow, so a group not ahead of the policy now
        # is not ahead of any step that trains it. Per-token versions matter only to the
        # mean bound, so they are read only under it (they cost a pass over the choices).
        newest = (
            newest_token_version(group)
            if mean_bound
            else newest_version(t.initial_policy_version for t in group.trajectories)
        )
        # With in-flight updates, a server takes up a step as soon as `backend.train` has
        # made it, before the trainer publishes it: tokens of the step being trained are
        # not from the future (the batches that can take this group train from it or later).
        trainer_version = run.gate.next_training_step if run.in_flight_updates else (
            run.gate.policy_version
        )
        future = None if newest is None or newest <= trainer_version else future_policy_error(
            newest, trainer_version, scenario_index=index, context=scenario_context(scenario)
        )
        if future is not None:
            # The run stops; the scenario is neither trained nor resolved.
            run.observers.note_failure(future)
            run.fates.settle(Fate.DROPPED_AT_STOP, index, rollout_s=wall)
            raise future
        mean_version = mean_policy_version(group) if mean_bound else None
        if run.gate.policy.drops_stale_early and run.freshness.is_stale(
            group_version, mean_version, run.gate.next_training_step
        ):
            # No batch still to be taken would accept it: drop it now, not after it queued.
            run.fates.settle(Fate.STALE, index, rollout_s=wall)
            return None
        return Delivered(
            group=group,
            scenario_index=index,
            rollout_wall_s=wall,
            actor_idle_s=idle_s,
            version=group_version,
            mean_version=mean_version,
            tokens=plain_tokens(group),
        )

    def _give_back(self, index: int, scenario: Any) -> bool:
        """Return a lost rollout's scenario to the source; False once lost too often."""
        losses = self.lost_rollouts.get(index, 0) + 1
        if losses >= MAX_LOSSES:
            self.lost_rollouts.pop(index, None)
            return False
        self.lost_rollouts[index] = losses
        self._emit(RolloutGivenBack(index))  # taken again when handed out again
        self.run.source.give_back(index, scenario)
        return True

    def _failed(self, worker_id: int, index: int, scenario: Any, failure: Exception) -> None:
        context = scenario_context(scenario)
        if isinstance(failure, RolloutLost):
            logger.warning(
                "Worker %d: rollout lost %d times: %r%s", worker_id, MAX_LOSSES, failure, context
            )
        else:
            logger.warning(
                "Worker %d: rollout failed (%s): %r%s", worker_id, _kind(failure), failure,
                context,
            )
        if self.run.stop.stopping:
            # Failed after the stop: left unresolved like the rest of what was in flight.
            self.run.fates.settle(Fate.DROPPED_AT_STOP, index)
            return
        self.run.fates.settle(Fate.ERRORED, index)
        self.failure_streak.append(index)
        limit = self.run.settings.shutdown.max_consecutive_rollout_failures
        if limit is None or len(self.failure_streak) != limit:
            return  # (past the limit: another worker already raised; all are cancelled)
        raise RolloutsKeepFailing(
            f"{limit} rollouts in a row failed, the last with {_kind(failure)}: {failure}. "
            "Fix rollout_fn or the service it calls, then resume: these scenarios were not "
            "marked done and will be rolled again. To keep going through failures, raise "
            f"max_consecutive_rollout_failures (now {limit}) or set it to None."
        ) from failure


def _kind(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}"


def _check_rollout_result(group: object) -> None:
    if not isinstance(group, TrajectoryGroup):
        raise RolloutRejected(
            f"rollout_fn returned {type(group).__name__}, not an art.TrajectoryGroup"
        )
    problem = rollout_problem(group)
    if problem is not None:
        raise RolloutRejected(problem)
