"""Behaviour 2, 3, 4: workers, the policy gate, what a rollout's group carries, bad rollouts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio import PipelineTrainer, trio_native
from tests.doubles import HISTORY_KEYS, RecordingBackend, asyncio_rollout, scenarios, trajectory


async def test_num_rollout_workers_run_concurrently(model, backend, autojump_clock):
    running = 0
    peak = 0

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(1)
        running -= 1
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(40), None,
        num_rollout_workers=5, min_batch_size=10, max_batch_size=10, admission="eager",
    ).train(handle_signals=False)
    assert peak == 5


async def test_on_policy_gate_starts_no_rollout_while_a_step_trains(model, autojump_clock):
    """With max_steps_off_policy=0 a rollout may start only at policy_version == next step."""
    backend = RecordingBackend(train_seconds=5.0)
    object.__setattr__(model, "_backend", backend)
    spans: list[tuple[float, float]] = []
    starts: list[float] = []

    original_train = backend.train

    async def timed_train(*args: Any, **kwargs: Any) -> Any:
        begin = trio.current_time()
        result = await original_train(*args, **kwargs)
        spans.append((begin, trio.current_time()))
        return result

    backend.train = timed_train  # type: ignore[method-assign]

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        starts.append(trio.current_time())
        await asyncio.sleep(1)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    for admission in ("eager", "staleness_aware"):
        spans.clear()
        starts.clear()
        await PipelineTrainer(
            model, backend, rollout, scenarios(100), None, num_rollout_workers=4,
            min_batch_size=2, max_batch_size=2, max_steps_off_policy=0, max_steps=3,
            admission=admission, resume=False,
        ).train(handle_signals=False)
        assert len(spans) == 3
        for begin, end in spans:
            assert not any(begin < t < end for t in starts), (admission, begin, end, starts)


async def test_groups_are_stamped_with_policy_versions_unless_already_set(model, backend):
    versions: list[tuple[int, tuple[Any, Any]]] = []
    original_train = backend.train

    async def spy(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        versions.extend(
            (backend.step + 1, (t.initial_policy_version, t.final_policy_version))
            for g in groups
            for t in g.trajectories
        )
        return await original_train(model, groups, **kwargs)

    backend.train = spy  # type: ignore[method-assign]

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        preset = trajectory(1.0, initial_policy_version=-7, final_policy_version=42)
        return art.TrajectoryGroup([trajectory(0.0), preset])

    await PipelineTrainer(
        model, backend, rollout, scenarios(4), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, max_steps_off_policy=10,
    ).train(handle_signals=False)
    stamped = [v for _, v in versions if v != (-7, 42)]
    assert len(stamped) == 4 and len(versions) == 8  # the preset pair is kept as set
    for step, (initial, final) in versions:
        if (initial, final) != (-7, 42):
            assert 0 <= initial <= final <= step - 1


async def test_scalar_scenario_metadata_is_copied_onto_the_group(model, backend):
    seen: list[dict[str, Any]] = []
    original_train = backend.train

    async def spy(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        seen.extend(dict(g.metadata) for g in groups)
        return await original_train(model, groups, **kwargs)

    backend.train = spy  # type: ignore[method-assign]
    items = [
        {"metadata": {"scenario_id": "a", "epoch": 2, "tags": ["x"], 3: "int key"}, "i": 0},
        {"metadata": {"scenario_id": "b", "difficulty": 0.5, "note": None}, "i": 1},
    ]
    await PipelineTrainer(
        model, backend, asyncio_rollout, items, None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    by_id = {m["scenario_id"]: m for m in seen}
    assert by_id["a"] == {"scenario_id": "a", "scenario_epoch": 2}
    assert by_id["b"] == {"scenario_id": "b", "scenario_difficulty": 0.5, "scenario_note": None}


async def test_rollout_wall_and_actor_idle_time_reach_the_step_metrics(model, autojump_clock):
    backend = RecordingBackend(train_seconds=1.0)
    object.__setattr__(model, "_backend", backend)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(2.0)
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(8), None, num_rollout_workers=4,
        min_batch_size=4, max_batch_size=4, max_steps_off_policy=0,
    ).train(handle_signals=False)
    rows = [json.loads(x) for x in (Path(model._get_output_dir()) / "history.jsonl").open()]
    keys = HISTORY_KEYS  # the installed ART line's names
    steps = {r["step"]: r for r in rows if keys["rollout_s"] in r}
    assert steps[1][keys["rollout_s"]] == pytest.approx(4 * 2.0)
    assert steps[1]["time/step_wall_s"] == pytest.approx(2.0 + 1.0)
    assert all(r[keys["backend_train_s"]] == pytest.approx(1.0) for r in steps.values())
    # On policy, workers wait at the gate while a step trains: that is actor idle time.
    assert any(r.get(keys["rollout_idle_s"], 0) > 0 for r in steps.values())


async def test_a_rollout_that_raises_or_returns_junk_is_errored_and_the_run_goes_on(
    model, backend, caplog
):
    async def rollout(model: Any, scenario: Any, config: Any) -> Any:
        if scenario["i"] == 1:
            raise KeyError("no such tool")
        if scenario["i"] == 2:
            return "not a group"
        return await asyncio_rollout(model, scenario, config)

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(6), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    await trainer.train(handle_signals=False)
    out = caplog.text
    assert "rollout failed (builtins.KeyError): KeyError('no such tool') [scenario_id=1]" in out
    assert "returned str, not an art.TrajectoryGroup" in out
    assert trainer.last_counters is not None
    assert trainer.last_counters.errored == 2
    assert sorted(i for c in backend.calls for i in c.scenario_ids) == [0, 3, 4, 5]


async def test_a_group_whose_every_rollout_failed_stops_the_run(model, backend):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([ValueError("boom"), ValueError("bang")])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(4), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    with pytest.RaisesGroup(
        pytest.RaisesExc(RuntimeError, match=r"All 2 rollouts in group failed\. First exception"),
    ):
        await trainer.train(handle_signals=False)


async def test_non_finite_rewards_are_errored_never_trained(model, backend, caplog):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        bad = float("nan") if scenario["i"] == 0 else float("inf") if scenario["i"] == 1 else 1.0
        return art.TrajectoryGroup([trajectory(0.0), trajectory(bad)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(4), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    assert sorted(i for c in backend.calls for i in c.scenario_ids) == [2, 3]
    assert "non-finite rewards" in caplog.text


async def test_native_group_rollout_via_make_group_rollout_fn(model, backend):
    from art_trio import make_group_rollout_fn

    calls = 0

    @trio_native
    async def single(model: Any, scenario: Any, config: Any) -> art.Trajectory:
        nonlocal calls
        calls += 1
        number = calls
        await trio.lowlevel.checkpoint()
        if number % 3 == 0:
            raise ValueError("flaky")
        return trajectory(float(number % 2))

    rollout = make_group_rollout_fn(single, n=3)
    await PipelineTrainer(
        model, backend, rollout, scenarios(2), None,
        num_rollout_workers=1, min_batch_size=1, max_batch_size=1, discard_queue_multiplier=50,
    ).train(handle_signals=False)
    assert calls == 6


async def test_a_rollout_that_always_fails_stops_the_run_and_leaves_its_scenarios_unresolved(
    model, backend
):
    broken = True

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if broken:
            raise ConnectionRefusedError("policy server is down")
        return await asyncio_rollout(model, scenario, config)

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(50), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, max_consecutive_rollout_failures=5,
    )
    with pytest.RaisesGroup(
        pytest.RaisesExc(Exception, match="5 rollouts in a row failed, the last with "
                         "builtins.ConnectionRefusedError: policy server is down"),
    ):
        await trainer.train(handle_signals=False)
    # Fixed: the resumed run trains the scenarios the broken one only failed on.
    broken = False
    await PipelineTrainer(
        model, backend, rollout, scenarios(6), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    assert sorted(i for c in backend.calls for i in c.scenario_ids) == list(range(6))


async def test_failures_between_successes_are_resolved_as_errored(model, backend):
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] % 2:
            raise ValueError("odd scenario")
        return await asyncio_rollout(model, scenario, config)

    await PipelineTrainer(
        model, backend, rollout, scenarios(9), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2, max_consecutive_rollout_failures=2,
    ).train(handle_signals=False)
    backend.calls.clear()
    await PipelineTrainer(
        model, backend, rollout, scenarios(9), None, num_rollout_workers=1,
        min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    assert backend.calls == []  # nothing left: the odd ones were resolved as errored


# -- rollouts the gate cancels because no batch can train them any more (doomed) -------------
#
# Strictly on-policy, batch 1, two workers: even scenarios take 1 s and odd ones 50 s, so each
# step is taken from a fast rollout while a slow one, started at the same version, is still
# running. The moment that step begins, no batch can train the slow one: the gate cancels it.
# Every worker keeps one cancel scope across its rollouts (rollout.py), so these also check
# that a worker carries on, with a fresh scope, after one of its rollouts was doomed.


async def _run_doomed(model: Any, backend: RecordingBackend, rollout: Any) -> PipelineTrainer:
    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(12), None,
        num_rollout_workers=2, min_batch_size=1, max_batch_size=1, max_steps_off_policy=0,
        max_steps=3,
    )
    await trainer.train(handle_signals=False)
    return trainer


def _assert_doomed_ones_were_not_trained(trainer: PipelineTrainer, backend: Any) -> None:
    trained = [i for c in backend.calls for i in c.scenario_ids]
    assert trained == [0, 2, 4]
    c = trainer.last_counters
    assert c is not None
    assert c.errored == 0, c
    # The slow rollouts of steps 1 and 2 (at least) were doomed and counted stale.
    assert c.stale_cancelled >= 2 and c.stale == c.stale_cancelled, c
    assert c.taken == c.trained + c.stale + c.zero_variance + c.errored + c.dropped_at_stop, c


async def test_a_doomed_rollout_is_cancelled_and_its_worker_rolls_on(
    model, backend, autojump_clock
):
    started: list[int] = []
    cancelled: list[int] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        started.append(scenario["i"])
        try:
            await asyncio.sleep(50 if scenario["i"] % 2 else 1)
        except asyncio.CancelledError:
            cancelled.append(scenario["i"])
            raise
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    trainer = await _run_doomed(model, backend, rollout)
    _assert_doomed_ones_were_not_trained(trainer, backend)
    # Scenario 3 starts only after scenario 1 was doomed: the worker went on.
    assert {1, 3} <= set(cancelled) and 3 in started


async def test_a_rollout_doomed_while_shielded_is_dropped_not_trained(
    model, backend, autojump_clock
):
    """The cancellation cannot reach it (a shielded rollout): it returns a group anyway."""
    finished: list[int] = []

    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        with trio.CancelScope(shield=True):
            await trio.sleep(50 if scenario["i"] % 2 else 1)
        finished.append(scenario["i"])
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    trainer = await _run_doomed(model, backend, rollout)
    _assert_doomed_ones_were_not_trained(trainer, backend)
    assert {1, 3} <= set(finished)


async def test_a_doomed_rollout_that_fails_on_cancellation_is_stale_not_errored(
    model, backend, autojump_clock
):
    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        try:
            await trio.sleep(50 if scenario["i"] % 2 else 1)
        except trio.Cancelled:
            raise RuntimeError("cleanup after cancellation failed") from None
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    trainer = await _run_doomed(model, backend, rollout)
    _assert_doomed_ones_were_not_trained(trainer, backend)


def test_doomed_rollouts_under_anyio_on_asyncio(model, backend):
    """The same under `anyio.run` on asyncio, where anyio cancels through task.cancel()."""
    cancelled: list[int] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        try:
            # Real time here: the slow ones never finish (doomed, or cancelled at the end).
            await asyncio.sleep(30 if scenario["i"] % 2 else 0.01)
        except asyncio.CancelledError:
            cancelled.append(scenario["i"])
            raise
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    trainer = anyio.run(_run_doomed, model, backend, rollout, backend="asyncio")
    _assert_doomed_ones_were_not_trained(trainer, backend)
    assert {1, 3} <= set(cancelled)


def test_a_doomed_rollout_is_cancelled_under_asyncio_too(model, backend) -> None:
    """Under anyio's asyncio backend the gate's cancellation ends in the rollout stage as it
    does under trio, a rollout that awaits cleanup on its cancellation included."""
    cancelled: list[int] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        try:
            await asyncio.sleep(2.0 if scenario["i"] % 2 else 0.05)
        except asyncio.CancelledError:
            cancelled.append(scenario["i"])
            await asyncio.sleep(0.01)  # cleanup that awaits
            raise
        return art.TrajectoryGroup([trajectory(0), trajectory(1)])

    trainer = anyio.run(_run_doomed, model, backend, rollout, backend="asyncio")
    _assert_doomed_ones_were_not_trained(trainer, backend)
    assert {1, 3} <= set(cancelled), cancelled
