"""A run watched only through its public seams: `statistics()` and `add_observer`.

Plus what those seams promise: immutable snapshots, one fate per scenario taken, observers that
can be removed, an observer's exception ending the run like a stage's, one source for the
settings' defaults and types, and a library that logs instead of printing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
from typing import Any, get_type_hints

import art
import pytest
import trio

import art_trio.config.keywords
import art_trio.config.settings
import art_trio.facade.trainer
from art_trio import (
    BatchTaken,
    Fate,
    GroupQueued,
    PipelineSettings,
    PipelineTrainer,
    PolicyPublished,
    RunEvent,
    RunStatistics,
    ScenarioSettled,
    StepTrained,
)
from art_trio.config.keywords import RESOLVED_LATER, keyword_type
from art_trio.config.settings import FIELDS, GROUP_TYPES
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory


def _trainer(model: Any, backend: Any, rollout: Any = asyncio_rollout, **kw: Any) -> Any:
    kw = {"num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 2, **kw}
    return PipelineTrainer(model, backend, rollout, scenarios(40), None, **kw)


async def test_a_run_seen_only_through_statistics_and_events(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any
) -> None:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        if scenario["i"] % 7 == 3:
            raise ValueError("planned")
        if scenario["i"] % 7 == 5:
            return art.TrajectoryGroup([trajectory(1.0), trajectory(1.0)])  # zero variance
        return await asyncio_rollout(model, scenario, config)

    backend.train_seconds = 0.05  # virtual: so the trainer has a utilization to report
    trainer = _trainer(model, backend, rollout, max_steps=6)
    before = trainer.statistics()
    assert not before.running and before.steps == 0 and before.num_rollout_workers == 4

    events: list[RunEvent] = []
    during: list[RunStatistics] = []

    def watch(event: RunEvent) -> None:
        events.append(event)
        if isinstance(event, StepTrained):
            during.append(trainer.statistics())

    trainer.add_observer(watch)
    await trainer.train(handle_signals=False)
    after = trainer.statistics()

    # Live during the run: one snapshot per step, each one step further, as the backend says.
    assert [s.steps for s in during] == list(range(1, 7))
    assert all(s.running for s in during) and not after.running
    assert [s.policy_version for s in during] == list(range(0, 6))  # published after the event
    assert all(s.num_rollout_workers == 4 and s.queue_capacity >= 1 for s in during)
    assert after.steps == 6 == backend.step

    # Every scenario taken ends once, and the events say the same as the counters.
    settled = [e for e in events if isinstance(e, ScenarioSettled)]
    assert len({e.scenario_index for e in settled}) == len(settled) == after.taken
    by_fate = {fate: sum(e.fate is fate for e in settled) for fate in Fate}
    assert by_fate[Fate.TRAINED] == after.trained == sum(len(c.rewards) for c in backend.calls)
    assert by_fate[Fate.ERRORED] == after.errored > 0
    assert by_fate[Fate.ZERO_VARIANCE] == after.zero_variance > 0
    assert by_fate[Fate.STALE] + by_fate[Fate.CANCELLED_STALE] == after.stale
    assert by_fate[Fate.DROPPED_AT_STOP] == after.dropped_at_stop
    trained_ids = sorted(e.scenario_index for e in settled if e.fate is Fate.TRAINED)
    steps = [e for e in events if isinstance(e, StepTrained)]
    stepped_ids = sorted(i for e in steps for i in e.scenario_indices)
    assert trained_ids == stepped_ids
    assert [e.version for e in events if isinstance(e, PolicyPublished)] == list(range(1, 7))
    # The queue balances: every group queued left it as part of a batch or discarded.
    queued = sum(isinstance(e, GroupQueued) for e in events)
    taken = sum(e.batch_size for e in events if isinstance(e, BatchTaken))
    discarded = sum(e.queued and e.fate is not Fate.TRAINED for e in settled)
    assert queued == taken + discarded
    assert after.groups_queued == 0 and after.rollouts_in_flight == 0

    # Measures of the whole run.
    assert sum(after.staleness.values()) == after.trained
    assert after.trainer_utilization is not None and 0 < after.trainer_utilization <= 1
    assert after.rollout_s_spent > 0 and after.rollout_s_per_trained_group is not None
    # Waiting for groups is part of each step's wall time, apart from training in it.
    assert all(0 <= e.idle_s <= e.wall_s - e.train_s + 1e-9 for e in steps)
    assert after.idle_s == pytest.approx(sum(e.idle_s for e in steps)) and after.idle_s > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.steps = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        after.staleness[0] = 1  # type: ignore[index]


def _unsettled_excess(s: RunStatistics) -> int:
    """How far `rollouts_in_flight + groups_queued` exceeds `taken - settled` (<= 0 holds)."""
    settled = s.trained + s.stale + s.zero_variance + s.errored + s.dropped_at_stop
    return s.rollouts_in_flight + s.groups_queued - (s.taken - settled)


@pytest.mark.parametrize("window", [0, 1])
async def test_no_snapshot_counts_more_in_flight_and_queued_than_taken_and_unsettled(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any, window: int
) -> None:
    """Every scenario taken and not settled is in one rollout, queued, or in the batch being
    trained, so `rollouts_in_flight + groups_queued <= taken - settled` between any two
    tasks' steps (what a thread polling `statistics()` sees). The in-flight figure counted the
    gate's admission slots: a slot taken for a worker the gate wakes, before that worker has
    taken a scenario, counted as a rollout."""

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        i = scenario["i"]
        if i % 7 == 3:
            raise ValueError("planned")
        await asyncio.sleep(0.1 * (1 + i % 5) + (5.0 if i % 11 == 4 else 0.0))  # asyncio code
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(120), None, num_rollout_workers=6,
        min_batch_size=2, max_batch_size=2, max_steps_off_policy=window, max_steps=8,
    )
    excess: list[tuple[str, int]] = []

    class BetweenTaskSteps(trio.abc.Instrument):
        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            s = trainer.statistics()
            if s.running and _unsettled_excess(s) > 0:
                excess.append((task.name, _unsettled_excess(s)))

    instrument = BetweenTaskSteps()
    trio.lowlevel.add_instrument(instrument)
    try:
        await trainer.train(handle_signals=False)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    after = trainer.statistics()
    assert after.steps == 8 and after.errored > 0 and after.stale > 0, after
    assert excess == [], sorted(set(excess))


async def test_a_removed_observer_hears_nothing_more(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any
) -> None:
    trainer = _trainer(model, backend, max_steps=1)
    heard: list[RunEvent] = []
    remove = trainer.add_observer(heard.append)
    remove()
    await trainer.train(handle_signals=False)
    assert heard == [] and backend.step == 1


async def test_an_observer_that_raises_ends_the_run_with_its_error(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any
) -> None:
    class Boom(Exception):
        pass

    def observer(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 2:
            raise Boom("observer broke")

    trainer = _trainer(model, backend, max_steps=5)
    trainer.add_observer(observer)
    with pytest.raises(ExceptionGroup) as caught:
        await trainer.train(handle_signals=False)
    assert caught.value.subgroup(Boom) is not None
    assert backend.step == 2 and trainer.statistics().trained == 4


def test_the_settings_have_one_source() -> None:
    """The constructor's defaults are the declarations' defaults, its settings keywords are
    typed as the declarations (see tests/test_settings_declaration.py for the rest), and the
    attributes the trainer reads back are the configured settings."""
    defaults = PipelineSettings()
    signature = inspect.signature(PipelineTrainer.__init__)
    for name, parameter in signature.parameters.items():
        if name in FIELDS and parameter.default is not None:
            assert parameter.default == defaults.get(name), name
    hints = {name: keyword_type(name) for name in FIELDS}
    declared = {
        name: get_type_hints(GROUP_TYPES[group], vars(art_trio.config.settings))[name]
        for name, group in FIELDS.items()
    }
    assert {n: hints[n] for n in declared if n not in RESOLVED_LATER} == {
        n: t for n, t in declared.items() if n not in RESOLVED_LATER
    }
    admission = signature.parameters["admission"].annotation
    assert "Literal['staleness_aware', 'eager']" in str(admission)


async def test_the_library_logs_and_prints_only_its_status_line(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: Any,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        if scenario["i"] == 1:
            raise KeyError("tool")
        return await asyncio_rollout(model, scenario, config)

    await _trainer(model, backend, rollout, max_steps=2).train(handle_signals=False)
    out = capsys.readouterr().out
    assert all(line.startswith("[status]") for line in out.splitlines() if line.strip()), out
    failures = [r for r in caplog.records if "rollout failed" in r.getMessage()]
    assert [r.name for r in failures] == ["art_trio"] and failures[0].levelno == logging.WARNING


async def test_the_run_leaves_the_garbage_collector_as_it_found_it(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any
) -> None:
    """The run freezes what existed before it (see supervision.long_lived_objects_frozen) and
    hands it back; objects the host froze make it leave the collector alone. Python 3.12's
    own start-up freeze is not the host's: the run freezes over it and releases it too."""
    before = gc.get_freeze_count()
    # Nobody froze anything in this test process (3.12's own start-up freeze aside).
    assert before <= art_trio.facade.supervision._FROZEN_BY_INTERPRETER
    seen: list[int] = []
    trainer = _trainer(model, backend, max_steps=1)
    trainer.add_observer(lambda event: seen.append(gc.get_freeze_count()))
    await trainer.train(handle_signals=False)
    assert seen and min(seen) > before  # frozen during the run
    assert gc.get_freeze_count() == 0  # and all handed back after it

    gc.freeze()
    try:
        hosts = gc.get_freeze_count()
        seen.clear()
        second = _trainer(model, backend, max_steps=1)
        second.add_observer(lambda event: seen.append(gc.get_freeze_count()))
        await second.train(handle_signals=False)
        # The host's freeze is neither added to during the run nor undone after it (the
        # count only falls as frozen objects are freed).
        assert seen and all(0 < count <= hosts for count in seen)
        assert 0 < gc.get_freeze_count() <= hosts
    finally:
        gc.unfreeze()
