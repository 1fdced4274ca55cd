"""Rollouts through a `rollout_executor` (ART 0.5.20's RolloutExecutor protocol).

The double runs each rollout in an asyncio task of its own, as a remote executor would run
it elsewhere, and can lose rollouts (its "worker" dies): the trainer must give those
scenarios back and roll them again, cancel doomed and stopped rollouts through it, and keep
exactly-once across a stop and resume.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import InProcessExecutor, PipelineTrainer, RolloutLost
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory


class TaskExecutor:
    """Runs each rollout in a separate asyncio task; loses the attempts named in `lose`.

    `lose` maps a scenario index to how many of its attempts die (the worker crashes
    mid-rollout: the task is cancelled and RolloutLost raised).
    """

    def __init__(self, lose: dict[int, int] | None = None, max_workers: int | None = None):
        self.lose = dict(lose or {})
        self.max_workers = max_workers
        self.target: int | None = None
        self.workers: tuple[int, ...] = ()
        self.attempts: dict[int, int] = {}
        self.cancelled: list[int] = []
        self.finished_remotely: list[int] = []

    def set_target(self, target_workers: int) -> None:
        self.target = target_workers

    def set_workers(self, worker_ids: tuple[int, ...]) -> None:
        self.workers = worker_ids

    async def run(
        self, worker_id: int, rollout_fn: Callable[..., Awaitable[Any]], model: Any,
        scenario: Any, config: Any,
    ) -> Any:
        assert worker_id in self.workers
        i = scenario["i"]
        self.attempts[i] = self.attempts.get(i, 0) + 1

        async def remote() -> Any:
            try:
                return await rollout_fn(model, scenario, config)
            except asyncio.CancelledError:
                self.cancelled.append(i)
                raise
            finally:
                self.finished_remotely.append(i)

        task = asyncio.get_running_loop().create_task(remote())
        if self.lose.get(i, 0) > 0:
            self.lose[i] -= 1
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise RolloutLost(f"worker {worker_id} died rolling out scenario {i}")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()  # cancel the "remote" work too, and wait until it is gone
            await asyncio.gather(task, return_exceptions=True)
            raise


def trained_indices(backend: RecordingBackend) -> list[int]:
    return [sid for call in backend.calls for sid in call.scenario_ids]


def state_record(model: Any) -> dict[str, Any]:
    state = json.loads((Path(model._get_output_dir()) / "state.json").read_text())
    record: dict[str, Any] = state["_pipeline_trainer"]
    return record


@pytest.mark.parametrize("admission", ["staleness_aware", "eager"])
async def test_lost_rollouts_are_rolled_again_and_trained_once(
    model: Any, backend: RecordingBackend, admission: str
) -> None:
    executor = TaskExecutor(lose={1: 1, 4: 2, 7: 1})
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(12), None, rollout_executor=executor,
        num_rollout_workers=3, min_batch_size=2, max_batch_size=2, admission=admission,
    )
    await trainer.train(handle_signals=False)
    assert executor.target == 3 and executor.workers == (0, 1, 2)
    assert executor.attempts[1] == 2 and executor.attempts[4] == 3 and executor.attempts[7] == 2
    counters = trainer.last_counters
    assert counters is not None and counters.rollouts_lost == 4
    assert counters.errored == 0 and counters.taken == 12
    trained = trained_indices(backend)
    assert sorted(trained) == list(range(12))  # every scenario once, the lost ones included
    assert state_record(model)["scenario_offset"] == 12


async def test_a_scenario_that_keeps_killing_its_worker_becomes_an_error(
    model: Any, backend: RecordingBackend
) -> None:
    executor = TaskExecutor(lose={2: 99})
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(6), None, rollout_executor=executor,
        num_rollout_workers=2, min_batch_size=1, max_batch_size=1,
    )
    await trainer.train(handle_signals=False)
    assert executor.attempts[2] == 3
    counters = trainer.last_counters
    assert counters is not None and counters.errored == 1 and counters.rollouts_lost == 2
    assert sorted(trained_indices(backend)) == [0, 1, 3, 4, 5]


async def test_a_stop_cancels_rollouts_inside_the_executor(
    model: Any, backend: RecordingBackend, autojump_clock: trio.testing.MockClock
) -> None:
    started = 0
    all_started = trio.Event()

    async def hour_long(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        nonlocal started
        started += 1
        if started == 3:
            all_started.set()
        await asyncio.sleep(3600)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    executor = TaskExecutor()
    trainer = PipelineTrainer(
        model, backend, hour_long, scenarios(10), None, rollout_executor=executor,
        num_rollout_workers=3, min_batch_size=1, max_batch_size=1, shutdown_grace_seconds=1.0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(trainer.train)
        await all_started.wait()
        begun = trio.current_time()
        trainer.request_stop()
    assert trio.current_time() - begun == pytest.approx(1.0, abs=0.01)
    assert sorted(executor.cancelled) == [0, 1, 2] == sorted(executor.finished_remotely)
    assert backend.calls == []
    assert state_record(model)["scenario_offset"] == 0  # all three roll again on resume


async def test_exactly_once_across_a_stop_and_resume_through_the_executor(
    model: Any, backend: RecordingBackend, autojump_clock: trio.testing.MockClock
) -> None:
    steps_done = trio.Event()

    async def slow(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(1 + scenario["i"] % 3)
        if len(backend.calls) >= 3:
            steps_done.set()
        return await asyncio_rollout(model, scenario, config)

    first = PipelineTrainer(
        model, backend, slow, scenarios(30), None, rollout_executor=TaskExecutor(lose={5: 1}),
        num_rollout_workers=4, min_batch_size=2, max_batch_size=2, shutdown_grace_seconds=0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(first.train)
        await steps_done.wait()
        first.request_stop()
    second = PipelineTrainer(
        model, backend, slow, scenarios(30), None, rollout_executor=TaskExecutor(lose={9: 1}),
        num_rollout_workers=4, min_batch_size=2, max_batch_size=2,
    )
    await second.train(handle_signals=False)
    trained = trained_indices(backend)
    assert len(trained) == len(set(trained))  # none twice
    assert sorted(trained) == list(range(30))  # none lost


def test_executor_capacity_as_art_checks_it(model: Any, backend: RecordingBackend) -> None:
    with pytest.raises(ValueError, match="num_rollout_workers=8 exceeds rollout executor "
                                         "capacity 4"):
        PipelineTrainer(
            model, backend, asyncio_rollout, [], None, num_rollout_workers=8,
            rollout_executor=TaskExecutor(max_workers=4),
        )
    clamped = PipelineTrainer(
        model, backend, asyncio_rollout, [], None, rollout_executor=TaskExecutor(max_workers=4)
    )
    assert clamped.num_rollout_workers == 4  # the default 16, clamped as ART does
    with pytest.raises(ValueError, match="rollout executor capacity must be >= 1"):
        PipelineTrainer(
            model, backend, asyncio_rollout, [], None,
            rollout_executor=TaskExecutor(max_workers=0),
        )
    with pytest.raises(TypeError, match="RolloutExecutor protocol"):
        PipelineTrainer(model, backend, asyncio_rollout, [], None, rollout_executor=object())


async def test_the_in_process_executor_and_arts_own(model: Any, backend: RecordingBackend) -> None:
    executors: list[Any] = [InProcessExecutor()]
    try:
        from art.distributed.rollout import LocalRolloutExecutor  # ART 0.5.20+
    except ImportError:
        pass
    else:
        executors.append(LocalRolloutExecutor())
    for executor in executors:
        backend.calls.clear()
        trainer = PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(4), None, rollout_executor=executor,
            num_rollout_workers=2, min_batch_size=2, max_batch_size=2, resume=False,
        )
        await trainer.train(handle_signals=False)
        assert sorted(trained_indices(backend)) == [0, 1, 2, 3], executor
