"""The rollout stage: `num_rollout_workers` workers turning scenarios into groups.

A worker first waits at the policy gate, then takes a scenario (so no scenario sits in a
waiting worker's hands), runs the user's rollout, and hands the group to the trainer over the
bounded groups channel. A group already too old for any batch still to come is dropped right
there instead of occupying the channel. When every worker has finished, the stage closes its
side of the channel and the trainer sees the end of the stream.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from art import TrajectoryGroup

from ..batching import (
    copy_scenario_metadata,
    non_finite_reward_error,
    scenario_context,
    stamp_policy_versions,
)
from ..bridge import BaseExceptionEscaped, CallbackNotAwaitable
from ..executor import RolloutLost
from ..gate import GateClosed
from ..metrics import mean_policy_version
from ..run import Delivered, PipelineRun


class RolloutRejected(Exception):
    """A rollout returned something the trainer cannot train."""


async def rollout_stage(run: PipelineRun, send: MemoryObjectSendStream[Delivered]) -> None:
    try:
        with run.rollout_scope:
            async with send, anyio.create_task_group() as workers:
                for worker_id in range(run.settings.num_rollout_workers):
                    workers.start_soon(_worker, run, worker_id, send.clone())
    finally:
        run.rollouts_done.set()
        run.stage_done("rollout")


async def _call_rollout(run: PipelineRun, worker_id: int, scenario: Any, version: int) -> Any:
    token = run.model.activate_metrics_context("train")
    try:
        # Leased for the whole call: the rollout samples from `version`'s weights.
        if run.executor is not None:
            return await run.call_leased(
                version, run.executor.run, worker_id, run.rollout_fn, run.model, scenario,
                run.config, lease=run.rollout_lease,
            )
        return await run.call_leased(
            version, run.rollout_fn, run.model, scenario, run.config, lease=run.rollout_lease
        )
    finally:
        token.var.reset(token)


async def _worker(
    run: PipelineRun, worker_id: int, send: MemoryObjectSendStream[Delivered]
) -> None:
    async with send:
        while True:
            # One cancel scope carries this worker's rollouts until the gate cancels one that no
            # batch can train any more; only then is a new one opened. Entering a scope costs
            # 3 to 6 us, too much to pay per rollout when rollouts are fast. The gate cancels
            # the scope only while a rollout is tracked in it (see `_roll`), so the
            # cancellation never lands in the gate, the source or the hand-over.
            with anyio.CancelScope() as doom_scope:
                await _serve(run, worker_id, send, doom_scope)
            if not doom_scope.cancel_called:
                return
            # A doomed rollout (already counted by `_roll`) ended the scope: open a new one.


async def _serve(
    run: PipelineRun,
    worker_id: int,
    send: MemoryObjectSendStream[Delivered],
    doom_scope: anyio.CancelScope,
) -> None:
    """Admit, roll out and hand over until the run ends or the gate dooms a rollout."""
    gate, counters = run.gate, run.counters
    # When this worker's previous rollout ended: from then until the next starts it is idle
    # (handing the group over, waiting at the gate), which the trainer reports per step.
    idle_since = run.now()
    while True:
        try:
            version = await gate.admit()
        except GateClosed:
            return
        handed_over = False
        try:
            taken = None if run.stopping else await run.source.take()
            if taken is None:
                return
            index, scenario = taken
            counters.taken += 1
            settled = False  # has this scenario's fate been counted?
            try:
                item = await _roll(run, worker_id, version, index, scenario, idle_since, doom_scope)
                idle_since = run.now()
                if item is None:
                    settled = True
                    if doom_scope.cancel_called:
                        return  # leave the cancelled scope before anything awaits in it
                    continue
                gate.hand_over(version)
                handed_over = True
                counters.max_queued = max(counters.max_queued, gate.queued)
                try:
                    # Waits only when the channel is full: the worker yields at the gate next
                    # (a second trip through the scheduler per rollout costs ~3 us under trio).
                    send.send_nowait(item)
                except anyio.WouldBlock:
                    blocked = run.now()
                    try:
                        await send.send(item)
                    except BaseException:
                        gate.withdraw()
                        raise
                    counters.put_wait_s += run.now() - blocked
                except BaseException:
                    gate.withdraw()
                    raise
                settled = True
                counters.delivered += 1
                run.status.note_group_enqueued(item.group)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the trainer stopped receiving: dropped at stop (below)
            finally:
                if not settled and not doom_scope.cancel_called:
                    # In flight, or handing over, when the run stopped or ended: neither
                    # trained nor resolved, so a resumed run rolls this scenario again.
                    # (A doomed rollout was counted as stale by `_roll`.)
                    counters.dropped_at_stop += 1
        finally:
            if not handed_over:
                gate.rollout_done(version)


async def _roll(
    run: PipelineRun,
    worker_id: int,
    version: int,
    index: int,
    scenario: Any,
    idle_since: float,
    doom_scope: anyio.CancelScope,
) -> Delivered | None:
    """Roll one scenario out; its group to deliver, or None once its fate is counted.

    The rollout runs tracked in the worker's `doom_scope`, which the gate cancels once no
    batch still to be taken could train it. A doomed rollout is counted as stale here, and
    the cancellation goes on up to the worker, which opens a new scope. Any other
    cancellation (a stop, the end of the run) propagates; the caller counts it as dropped.
    """
    gate, status, counters = run.gate, run.status, run.counters
    counters.rollouts_started += 1
    status.note_rollout_started()
    errored = True
    failure: Exception | None = None
    started = run.now()
    doomed = lost = False
    try:
        gate.track(version, doom_scope)
        try:
            group = await _call_rollout(run, worker_id, scenario, version)
        finally:
            gate.untrack(version, doom_scope)
            doomed = doom_scope.cancel_called
        if not doomed:
            _check_rollout_result(group)
        errored = False
    except anyio.get_cancelled_exc_class():
        errored = False  # stopped or doomed, not failed
        if doomed:
            _count_doomed(run, index, run.now() - started)
        raise
    except (BaseExceptionEscaped, CallbackNotAwaitable):
        # A KeyboardInterrupt or SystemExit, or a rollout_fn that can never work: not this
        # scenario's failure. The run ends; the scenario stays unresolved.
        errored = False
        raise
    except RolloutLost as exc:
        if _give_back(run, index, scenario):
            errored = False
            lost = True
        else:
            failure = exc
            context = scenario_context(scenario)
            print(f"Worker {worker_id}: rollout lost {MAX_LOSSES} times: {exc!r}{context}")
    except Exception as exc:
        if doomed:
            errored = False  # whatever the rollout made of its cancellation, it was doomed
        else:
            failure = exc
            context = scenario_context(scenario)
            print(f"Worker {worker_id}: rollout failed ({_kind(exc)}): {exc!r}{context}")
    finally:
        status.note_rollout_finished(errored=errored)
    wall = run.now() - started
    if lost:
        return None  # given back: another take rolls it again
    if doomed:
        # Doomed after its last checkpoint: its result is of no use to any batch.
        _count_doomed(run, index, wall)
        return None
    gate.note_rollout_time(wall, completed=True)
    if run.stopping:
        # Finished after the stop: not trained and not resolved, so a resumed run rolls it
        # again.
        counters.dropped_at_stop += 1
        return None
    if failure is not None:
        counters.errored += 1
        _note_failure(run, index, failure)
        return None
    counters.rollout_s += wall
    counters.rollout_idle_s += started - idle_since
    # A rollout got through: the failures before it were the scenarios' own.
    run.state.ledger.resolve_all(run.failure_streak)
    run.failure_streak.clear()
    copy_scenario_metadata(group, scenario)
    group_version = stamp_policy_versions(group, initial=version, final=gate.policy_version)
    mean_version = (
        mean_policy_version(group)
        if run.freshness.limit_mean_steps_off_policy is not None
        else None
    )
    if gate.drops_stale_early and run.freshness.is_stale(
        group_version, mean_version, gate.next_training_step
    ):
        # No batch still to be taken would accept it: drop it now, not after it queued.
        counters.stale += 1
        counters.stale_rollout_s += wall
        status.note_stale(1)
        run.state.ledger.resolve(index)
        return None
    return Delivered(
        group=group,
        scenario_index=index,
        rollout_wall_s=wall,
        actor_idle_s=started - idle_since,
        version=group_version,
        mean_version=mean_version,
    )


#: Times one scenario's rollout may be lost (its executor worker dying) before the loss
#: counts as that rollout's error: a scenario that kills its worker must not loop forever.
MAX_LOSSES = 3


def _give_back(run: PipelineRun, index: int, scenario: Any) -> bool:
    """Return a lost rollout's scenario to the source; False once it was lost too often."""
    losses = run.lost_rollouts.get(index, 0) + 1
    if losses >= MAX_LOSSES:
        run.lost_rollouts.pop(index, None)
        return False
    run.lost_rollouts[index] = losses
    run.counters.rollouts_lost += 1
    run.counters.taken -= 1  # taken again when handed out again
    run.source.give_back(index, scenario)
    return True


def _count_doomed(run: PipelineRun, index: int, wall: float) -> None:
    """A rollout the gate cancelled because no batch still to be taken could train it."""
    # Its time counts as a censored latency sample: cancelled rollouts are the slow ones.
    run.gate.note_rollout_time(wall, completed=False)
    run.counters.stale += 1
    run.counters.stale_cancelled += 1
    run.counters.cancelled_rollout_s += wall
    run.status.note_stale(1)
    run.state.ledger.resolve(index)


class RolloutsKeepFailing(RuntimeError):
    """Too many rollouts failed in a row: the rollout code or what it calls is broken."""


def _kind(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}"


def _note_failure(run: PipelineRun, index: int, failure: Exception) -> None:
    run.failure_streak.append(index)
    limit = run.settings.max_consecutive_rollout_failures
    if limit is None or len(run.failure_streak) != limit:
        return  # (past the limit: another worker already raised, and all are being cancelled)
    raise RolloutsKeepFailing(
        f"{limit} rollouts in a row failed, the last with {_kind(failure)}: {failure}. Fix "
        "rollout_fn or the service it calls, then resume: these scenarios were not marked "
        "done and will be rolled again. To keep going through failures, raise "
        f"max_consecutive_rollout_failures (now {limit}) or set it to None."
    ) from failure


def _check_rollout_result(group: object) -> None:
    if not isinstance(group, TrajectoryGroup):
        raise RolloutRejected(
            f"rollout_fn returned {type(group).__name__}, not an art.TrajectoryGroup"
        )
    problem = non_finite_reward_error(group)
    if problem is not None:
        raise RolloutRejected(problem)


__all__ = ["RolloutRejected", "RolloutsKeepFailing", "rollout_stage"]
