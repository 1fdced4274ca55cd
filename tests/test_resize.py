"""Live resizing: `trainer.resize` while `train()` runs, under trio's MockClock."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer, trio_native
from art_trio.messages.events import Resized, RunEvent, StepTrained
from tests.doubles import RecordingBackend, scenarios, trajectory


class Concurrency:
    """A trio-native rollout of fixed latency that tracks how many run at once."""

    def __init__(self, latency: float = 1.0) -> None:
        self.latency = latency
        self.running = 0
        self.peak = 0
        self.started = 0

    def reset_peak(self) -> None:
        self.peak = self.running

    @property
    def fn(self) -> Any:
        @trio_native
        async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
            self.running += 1
            self.started += 1
            self.peak = max(self.peak, self.running)
            try:
                await trio.sleep(self.latency)
            finally:
                self.running -= 1
            return art.TrajectoryGroup([trajectory(0), trajectory(1)])

        return rollout


def _check_accounting(trainer: PipelineTrainer[Any, Any], backend: RecordingBackend) -> None:
    ids = backend.trained_ids
    assert len(ids) == len(set(ids)), "a scenario was trained twice"
    c = trainer.last_counters
    assert c is not None
    assert c.trained == len(ids)
    settled = c.trained + c.stale + c.zero_variance + c.errored + c.dropped_at_stop
    assert settled == c.taken, "a scenario taken was never settled"


def _trainer(model: Any, backend: RecordingBackend, rollout: Any, n: int, **kw: Any) -> Any:
    kw.setdefault("num_rollout_workers", 2)
    kw.setdefault("min_batch_size", 2)
    kw.setdefault("max_batch_size", 2)
    return PipelineTrainer(model, backend, rollout, scenarios(n), None, resume=False,
                           admission="eager", max_steps_off_policy=8, **kw)


async def test_grow_workers_mid_run(model, autojump_clock):
    backend = RecordingBackend(train_seconds=0.5)
    object.__setattr__(model, "_backend", backend)
    roll = Concurrency()
    trainer = _trainer(model, backend, roll.fn, 60)
    events: list[RunEvent] = []
    trainer.add_observer(events.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        await trio.sleep(3.5)
        assert roll.peak == 2
        assert trainer.statistics().num_rollout_workers == 2
        stats = trainer.resize(num_rollout_workers=6, reason="grow")
        assert stats.num_rollout_workers == 6
        await trio.sleep(2.5)
        assert roll.peak == 6
        assert trainer.statistics().num_rollout_workers == 6
    resized = [e for e in events if isinstance(e, Resized)]
    assert [(e.num_rollout_workers, e.reason) for e in resized] == [(6, "grow")]
    _check_accounting(trainer, backend)
    assert trainer.last_counters.taken == 60


async def test_shrink_workers_mid_run(model, autojump_clock):
    backend = RecordingBackend(train_seconds=0.5)
    object.__setattr__(model, "_backend", backend)
    roll = Concurrency()
    trainer = _trainer(model, backend, roll.fn, 80, num_rollout_workers=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        await trio.sleep(2.5)
        assert roll.peak == 8
        trainer.resize(num_rollout_workers=2)
        # Busy workers finish the rollout they hold, then leave.
        await trio.sleep(1.5)
        assert trainer.statistics().num_rollout_workers == 2
        roll.reset_peak()
        started = roll.started
        await trio.sleep(5)
        assert roll.peak <= 2
        # The two left keep rolling out (an instant's count may catch both at the gate).
        assert roll.started > started
    _check_accounting(trainer, backend)
    assert trainer.last_counters.taken == 80


async def test_shrink_then_grow_in_one_tick_keeps_the_target(model, autojump_clock):
    backend = RecordingBackend(train_seconds=0.5)
    object.__setattr__(model, "_backend", backend)
    roll = Concurrency()
    trainer = _trainer(model, backend, roll.fn, 60, num_rollout_workers=6)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        await trio.sleep(1.5)
        trainer.resize(num_rollout_workers=1)
        trainer.resize(num_rollout_workers=4)
        await trio.sleep(3)
        assert trainer.statistics().num_rollout_workers == 4
        roll.reset_peak()
        await trio.sleep(3)
        assert roll.peak == 4
    _check_accounting(trainer, backend)


async def test_batch_sizes_apply_from_the_next_batch(model, autojump_clock):
    backend = RecordingBackend(train_seconds=1.0)
    object.__setattr__(model, "_backend", backend)
    roll = Concurrency(latency=0.25)
    trainer = _trainer(model, backend, roll.fn, 200, num_rollout_workers=8)

    def on_step(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 3:
            trainer.resize(min_batch_size=5, max_batch_size=5)

    trainer.add_observer(on_step)
    await trainer.train(handle_signals=False)
    sizes = [len(call.scenario_ids) for call in backend.calls]
    assert sizes[:3] == [2, 2, 2]
    # The batch being collected when the step ended may already be taken at the old size.
    assert set(sizes[4:-1]) == {5}
    _check_accounting(trainer, backend)


async def test_queue_capacity_growth_wakes_blocked_workers(model, autojump_clock):
    backend = RecordingBackend(train_seconds=100.0)
    object.__setattr__(model, "_backend", backend)
    roll = Concurrency(latency=1.0)
    trainer = _trainer(model, backend, roll.fn, 100, num_rollout_workers=4,
                       min_batch_size=1, max_batch_size=1, queue_maxsize=1, max_steps=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        await trio.sleep(50)
        # The first step trains for 100 s; the channel (1) is full and workers block on it.
        before = roll.started
        assert trainer.statistics().queue_capacity == 1
        await trio.sleep(10)
        assert roll.started == before
        stats = trainer.resize(queue_maxsize=8)
        assert stats.queue_capacity == 8
        await trio.sleep(5)
        assert roll.started > before
        trainer.request_stop()
    _check_accounting(trainer, backend)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_rollout_workers": 0},
        {"min_batch_size": 0},
        {"min_batch_size": 5, "max_batch_size": 3},
        {"queue_maxsize": 0},
    ],
)
async def test_bad_sizes_raise_value_error(model, backend, kwargs, autojump_clock):
    trainer = _trainer(model, backend, Concurrency().fn, 4)
    with pytest.raises(ValueError):
        trainer.resize(**kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        with pytest.raises(ValueError):
            trainer.resize(**kwargs)
        trainer.request_stop()


async def test_resize_before_train_changes_the_next_run(model, backend, autojump_clock):
    roll = Concurrency()
    trainer = _trainer(model, backend, roll.fn, 12)
    stats = trainer.resize(num_rollout_workers=3)
    assert stats.num_rollout_workers == 3 and trainer.num_rollout_workers == 3
    await trainer.train(handle_signals=False)
    assert roll.peak == 3
    assert Counter(backend.trained_ids) == Counter(range(12))


async def test_a_resize_during_a_run_is_the_trainers_settings_and_the_next_runs(
    model, backend, autojump_clock
):
    # One settings object: what a run was resized to is what the trainer reports, during the
    # run and after it, and what its next run starts with.
    roll = Concurrency()
    trainer = _trainer(model, backend, roll.fn, 24)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        trainer.resize(num_rollout_workers=4, max_batch_size=3)
        assert trainer.settings.sizes.num_rollout_workers == trainer.num_rollout_workers == 4
        assert trainer.max_batch_size == trainer.statistics().max_batch_size == 3
    assert (trainer.num_rollout_workers, trainer.max_batch_size) == (4, 3)
    roll.peak = 0
    await trainer.train(handle_signals=False)
    assert roll.peak == 4
