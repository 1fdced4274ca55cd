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
    group_initial_version,
    non_finite_reward_error,
    scenario_context,
    stamp_policy_versions,
    version_is_stale,
)
from ..gate import GateClosed
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


async def _call_rollout(run: PipelineRun, scenario: Any, version: int) -> Any:
    token = run.model.activate_metrics_context("train")
    try:
        # Leased for the whole call: the rollout samples from `version`'s weights.
        return await run.call_leased(version, run.rollout_fn, run.model, scenario, run.config)
    finally:
        token.var.reset(token)


async def _worker(
    run: PipelineRun, worker_id: int, send: MemoryObjectSendStream[Delivered]
) -> None:
    gate, counters = run.gate, run.counters
    # Time this worker spent blocked handing its previous group over, charged to the next one.
    handover_wait = 0.0
    async with send:
        while True:
            wait_started = run.now()
            try:
                version = await gate.admit()
            except GateClosed:
                return
            actor_idle = run.now() - wait_started + handover_wait
            handed_over = False
            try:
                taken = None if run.stopping else await run.source.take()
                if taken is None:
                    return
                index, scenario = taken
                counters.taken += 1
                settled = False  # has this scenario's fate been counted?
                try:
                    item = await _roll(run, worker_id, version, index, scenario, actor_idle)
                    if item is None:
                        settled = True
                        continue
                    gate.hand_over(version)
                    handed_over = True
                    counters.max_queued = max(counters.max_queued, gate.queued)
                    handover_started = run.now()
                    try:
                        await send.send(item)
                    except BaseException:
                        gate.withdraw()
                        raise
                    settled = True
                    counters.delivered += 1
                    run.status.note_group_enqueued(item.group)
                    handover_wait = run.now() - handover_started
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the trainer stopped receiving: dropped at stop (below)
                finally:
                    if not settled:
                        # In flight, or handing over, when the run stopped or ended: neither
                        # trained nor resolved, so a resumed run rolls this scenario again.
                        counters.dropped_at_stop += 1
            finally:
                if not handed_over:
                    gate.rollout_done(version)


async def _roll(
    run: PipelineRun, worker_id: int, version: int, index: int, scenario: Any, actor_idle: float
) -> Delivered | None:
    """Roll one scenario out; its group to deliver, or None once its fate is counted.

    Cancellation (a stop, the end of the run) propagates; the caller counts it as dropped.
    """
    gate, status, counters = run.gate, run.status, run.counters
    counters.rollouts_started += 1
    status.note_rollout_started()
    errored = True
    failure: Exception | None = None
    try:
        started = run.now()
        with anyio.CancelScope() as scope:
            gate.track(version, scope)
            try:
                group = await _call_rollout(run, scenario, version)
            finally:
                gate.untrack(version, scope)
        wall = run.now() - started
        doomed = scope.cancelled_caught
        gate.note_rollout_time(wall, completed=not doomed)
        if not doomed:
            _check_rollout_result(group)
        errored = False
    except anyio.get_cancelled_exc_class():
        errored = False  # stopped, not failed: the caller counts it as dropped
        raise
    except Exception as exc:
        failure = exc
        context = scenario_context(scenario)
        print(f"Worker {worker_id}: rollout failed ({_kind(exc)}): {exc!r}{context}")
    finally:
        status.note_rollout_finished(errored=errored)
    if run.stopping:
        # Finished after the stop: not trained and not resolved, so a resumed run rolls it
        # again.
        counters.dropped_at_stop += 1
        return None
    if failure is not None:
        counters.errored += 1
        _note_failure(run, index, failure)
        return None
    # A rollout got through: the failures before it were the scenarios' own.
    run.state.ledger.resolve_all(run.failure_streak)
    run.failure_streak.clear()
    if doomed:
        # Cancelled by the gate: no batch still to be taken could train it.
        counters.stale += 1
        counters.stale_cancelled += 1
        status.note_stale(1)
        run.state.ledger.resolve(index)
        return None
    copy_scenario_metadata(group, scenario)
    stamp_policy_versions(group, initial=version, final=gate.policy_version)
    group_version = group_initial_version(group)
    if gate.drops_stale_early and version_is_stale(group_version, gate.min_fresh_version):
        # No batch still to be taken would accept it: drop it now, not after it queued.
        counters.stale += 1
        status.note_stale(1)
        run.state.ledger.resolve(index)
        return None
    return Delivered(
        group=group,
        scenario_index=index,
        rollout_wall_s=wall,
        actor_idle_s=actor_idle,
        version=group_version,
    )


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
