"""A workload's doubles: the backend, rollout and eval functions a trainer is fed with.

They stand in for an LLM inference server (rollouts) and a trainer (``backend.train``) with
sleeps drawn from the workload's seeded distributions, and record into a
:class:`~art_trio.sim.recorder.Recorder` what the pipeline trainer did with them. The backend
and eval doubles are :mod:`art_trio.testing`'s, the one implementation of ART's protocol.

They await only anyio primitives by default, so the very same objects work under ART's
asyncio ``PipelineTrainer``, under art_trio on trio or on asyncio, and under trio's
``MockClock`` where time is virtual. Latency draws are indexed by scenario id (not by the
order in which rollouts happen to start), so two trainers fed the same workload and seed see
the same latency for the same scenario.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import art

from art_trio.sim.host import HostCPU
from art_trio.sim.inference import ProcessorSharing
from art_trio.sim.recorder import Recorder
from art_trio.sim.workloads import Workload
from art_trio.testing.distributions import IndexedDraws, LatencyDist, draws_for
from art_trio.testing.doubles import (
    BackendDouble,
    EvalCall,
    EvalDouble,
    Flavor,
    TrainBatch,
    clock_for,
    trajectory_group,
)

__all__ = [
    "EvalFn",
    "RolloutFailed",
    "RolloutFn",
    "SyntheticBackend",
    "eval_double",
    "make_eval_fn",
    "make_rollout_fn",
]

RolloutFn = Callable[[Any, dict[str, Any], Any], Awaitable[art.TrajectoryGroup]]
EvalFn = Callable[[Any, int, Any], Awaitable[list[art.Trajectory | art.TrajectoryGroup]]]


class SyntheticBackend(BackendDouble):
    """The backend double with train times drawn from ``train_time``, recording every step.

    ``on_step`` (optional) is called after each recorded step (the simulator's progress).
    """

    def __init__(
        self,
        train_time: LatencyDist,
        recorder: Recorder,
        *,
        seed: int = 0,
        initial_step: int = 0,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            train_time=draws_for(train_time, (seed, 2)),
            initial_step=initial_step,
            inference_endpoint=("http://synthetic.invalid/v1", "synthetic"),
        )
        self.recorder = recorder
        self._on_step = on_step

    def record(self, batch: TrainBatch) -> None:
        self.recorder.record_step(
            step=batch.step,
            base_version=batch.base_version,
            start=batch.start,
            end=batch.end,
            groups=batch.groups,
        )
        if self._on_step is not None:
            self._on_step()


class RolloutFailed(RuntimeError):
    """Raised by the rollout double for scenarios drawn to fail."""


def make_rollout_fn(
    workload: Workload, recorder: Recorder, *, flavor: Flavor = "anyio"
) -> RolloutFn:
    """A ``rollout_fn(model, scenario, config) -> TrajectoryGroup`` for ``workload``.

    ``flavor="asyncio"`` makes it asyncio code (``asyncio.sleep``, the loop's clock), as ART
    users' rollouts are: under trio it then crosses the trio-asyncio bridge, the path users
    take. ``"anyio"`` (default) runs natively on either loop (the simulator's and the
    benchmark's ``trio-native`` kind).

    It records the start, takes the scenario's latency (its draw, scaled by the workload's
    latency shift, served by a processor-sharing inference server when the workload has an
    inference capacity; a cancellation meanwhile is recorded), then (by a per-scenario draw)
    fails with :class:`RolloutFailed`, returns a zero-variance group (all rewards equal, which
    trainers discard), or returns a group of ``trajectories_per_group`` distinct rewards.
    The group carries ``metadata["scenario_id"]``.
    """
    latency = draws_for(workload.rollout_latency, (workload.seed, 1))
    outcome_p = workload.failure_prob + workload.zero_variance_prob
    uniform: Callable[[int], float] = (
        IndexedDraws(lambda rng, n: rng.random(n), (workload.seed, 3)).__getitem__
        if outcome_p > 0
        else (lambda _index: 1.0)
    )
    n = workload.trajectories_per_group
    varied = tuple(i / (n - 1) for i in range(n))
    flat = (0.5,) * n
    sleep, now = clock_for(flavor)
    shift = workload.latency_shift
    wait: Callable[[float], Awaitable[None]] = sleep
    if workload.inference_capacity is not None:
        wait = ProcessorSharing(workload.inference_capacity, flavor=flavor).serve
    # The trainer process's CPU per rollout, half on starting it, half on its end (finished
    # or cancelled); zero: CPU is free, as virtual time makes it by default.
    cpu = HostCPU(flavor=flavor) if workload.rollout_cpu_s > 0 else None
    half_cpu = workload.rollout_cpu_s / 2

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        scenario_id = int(scenario["id"])
        if cpu is not None:
            await cpu.spend(half_cpu)
        recorder.rollout_started(scenario_id, now())
        seconds = latency(scenario_id)
        if shift is not None:
            seconds *= shift.scale(len(recorder.steps))
        served = False
        try:
            await wait(seconds)
            served = True
            if cpu is not None:
                await cpu.spend(half_cpu)  # booked at once: a cancel meanwhile owes nothing
        except BaseException:
            # Cancelled mid-rollout (a trainer dropping a doomed rollout, or shutdown): the
            # inference time spent so far is still spent, so it is recorded.
            recorder.rollout_cancelled(scenario_id, now())
            if cpu is not None and not served:
                cpu.charge(half_cpu)  # the cancellation's own clean-up
            raise
        u = uniform(scenario_id)
        if u < workload.failure_prob:
            recorder.rollout_finished(scenario_id, now(), "failed")
            raise RolloutFailed(f"synthetic failure of scenario {scenario_id}")
        zero_variance = u < outcome_p
        group = trajectory_group(flat if zero_variance else varied, scenario_id=scenario_id)
        recorder.rollout_finished(scenario_id, now(), "zero_variance" if zero_variance else "ok")
        return group

    return rollout


def make_eval_fn(workload: Workload, recorder: Recorder) -> EvalFn | None:
    """An ``eval_fn(model, step, config)`` working ``workload.eval_time``, or None if unset."""
    if workload.eval_time is None:
        return None
    return eval_double(workload.eval_time, recorder)


def eval_double(
    eval_time: float | LatencyDist, recorder: Recorder, *, seed: int = 0
) -> EvalDouble:
    """The eval double, recording each completed eval into ``recorder.evals``.

    ``eval_time`` is a fixed number of seconds or a distribution (draw ``i`` for eval ``i``).
    """
    durations = (
        IndexedDraws(eval_time.sample_n, (seed, 4)).__getitem__
        if isinstance(eval_time, LatencyDist)
        else float(eval_time)
    )

    def done(call: EvalCall) -> None:
        if call.completed and call.ended_at is not None:
            recorder.evals.append((call.step, call.started_at, call.ended_at))

    return EvalDouble(durations, on_end=done)
