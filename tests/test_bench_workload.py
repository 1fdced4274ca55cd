"""Fast tests of the benchmark's workload doubles and metric computations (no wall-time checks)."""

from __future__ import annotations

import math
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

from art_trio.bench.report import Cell, format_staleness, main_table, sweep_table
from art_trio.bench.runner import build_parser
from art_trio.bench.trainers import KNOB, run_one
from art_trio.sim.doubles import RolloutFailed, SyntheticBackend, make_eval_fn, make_rollout_fn
from art_trio.sim.measures import RunReport, measure
from art_trio.sim.recorder import Recorder, StepRecord
from art_trio.sim.workloads import PRESETS, Workload, scenarios
from art_trio.testing.distributions import (
    Constant,
    Empirical,
    Exponential,
    IndexedDraws,
    LogNormal,
)

# --- distributions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dist", "rel_tol"),
    [
        (Constant(0.1), 0.0),
        (Exponential(0.05), 0.01),
        # sigma 1.5: sd is ~2.9x the mean, so 1e6 draws give ~0.3% standard error.
        (LogNormal(0.05, 1.5), 0.02),
        (Empirical((0.01, 0.02, 0.09)), 0.01),
    ],
)
def test_distribution_means(dist: Any, rel_tol: float) -> None:
    draws = dist.sample_n(np.random.default_rng(1234), 1_000_000)
    assert draws.min() >= 0
    assert float(draws.mean()) == pytest.approx(dist.mean, rel=rel_tol, abs=1e-12)


def test_lognormal_is_parameterised_by_mean_not_median() -> None:
    dist = LogNormal(0.05, 1.5)
    draws = dist.sample_n(np.random.default_rng(7), 200_000)
    # median = exp(mu) = mean * exp(-sigma^2 / 2)
    assert float(np.median(draws)) == pytest.approx(0.05 * math.exp(-1.125), rel=0.02)


def test_sampling_is_reproducible_per_seed() -> None:
    a = Exponential(0.05).sample_n(np.random.default_rng(3), 10)
    b = Exponential(0.05).sample_n(np.random.default_rng(3), 10)
    c = Exponential(0.05).sample_n(np.random.default_rng(4), 10)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_indexed_draws_do_not_depend_on_request_order() -> None:
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.random(n)

    in_order = IndexedDraws(draw, (0, 1))
    expected = [in_order[i] for i in range(10_000)]
    shuffled = IndexedDraws(draw, (0, 1))
    for i in (9_999, 3, 5_000, 4_096, 0):
        assert shuffled[i] == expected[i]


def test_invalid_distributions_rejected() -> None:
    with pytest.raises(ValueError):
        Exponential(0)
    with pytest.raises(ValueError):
        Empirical(())
    with pytest.raises(ValueError):
        Constant(-1)


# --- metrics on hand-made records --------------------------------------------------------------


def _hand_made() -> Recorder:
    """Two steps: [1.0, 1.1] and [1.3, 1.4]; six rollouts with known fates."""
    rec = Recorder()
    rollouts = {
        # id: (start, end or None, outcome)
        0: (0.0, 0.5, "ok"),  # trained at step 1
        1: (0.0, 0.6, "ok"),  # trained at step 2 (1 step stale)
        2: (0.2, 0.9, "ok"),  # completed, never trained: waste
        3: (0.3, 1.35, "ok"),  # completed during the last step: tail, not waste
        4: (0.4, 0.8, "failed"),  # failed: not waste
        5: (1.35, 1.38, "ok"),  # started after the last step began: not eligible
        6: (1.0, None, "ok"),  # never completed: eligible, not waste
        7: (0.5, 0.7, "cancelled"),  # cancelled part-way: not waste, but wasted work
    }
    for sid, (start, end, outcome) in rollouts.items():
        rec.rollout_started(sid, start)
        if end is not None and outcome == "cancelled":
            rec.rollout_cancelled(sid, end)
        elif end is not None:
            rec.rollout_finished(sid, end, outcome)  # type: ignore[arg-type]
    rec.steps = [
        StepRecord(1, 0, 1.0, 1.1, 1, (0,), (0,)),
        StepRecord(2, 1, 1.3, 1.4, 1, (1,), (0,)),
    ]
    rec.staleness.update({0: 1, 1: 1})
    rec.groups_trained = 2
    rec.train_called_at = 0.0
    rec.train_returned_at = 1.9
    return rec


def test_measure_utilization_throughput_and_return_latency() -> None:
    report = measure(_hand_made())
    assert report.steps == 2 and report.groups == 2
    assert report.window_s == pytest.approx(0.4)
    assert report.utilization == pytest.approx(0.2 / 0.4)
    assert report.steps_per_s == pytest.approx(2 / 0.4)
    assert report.groups_per_s == pytest.approx(2 / 0.4)
    assert report.return_latency_s == pytest.approx(0.5)
    assert report.wall_s == pytest.approx(1.9)


def test_measure_waste() -> None:
    report = measure(_hand_made())
    # eligible: started before 1.3 -> ids 0,1,2,3,4,6,7
    assert report.started_before_last_step == 7
    assert report.wasted == 1  # id 2
    assert report.waste == pytest.approx(1 / 7)
    assert report.waste_incl_tail == pytest.approx(2 / 7)  # ids 2 and 3
    assert report.cancelled_share == pytest.approx(1 / 7)  # id 7
    assert report.rollouts_failed == 1 and report.rollouts_cancelled == 1


def test_measure_wasted_work() -> None:
    report = measure(_hand_made())
    # rollout-seconds of eligible rollouts: 0.5 + 0.6 (trained) + 0.7 + 1.05 + 0.4 (failed)
    # + 0.9 (id 6, open until train() returned at 1.9) + 0.2 (cancelled)
    wasted = 0.7 + 1.05 + 0.9 + 0.2
    assert report.wasted_work == pytest.approx(wasted / 4.35)


def test_measure_staleness_from_backend_records() -> None:
    rec = Recorder()
    backend_groups = _groups_at_versions([0, 0, 1])
    rec.record_step(step=2, base_version=1, start=0.0, end=1.0, groups=backend_groups)
    assert measure(rec).staleness == {0: 1, 1: 2}
    assert rec.steps[0].scenario_ids == (0, 1, 2)


def test_measure_without_steps_is_nan_not_error() -> None:
    report = measure(Recorder())
    assert report.steps == 0 and math.isnan(report.utilization)


def test_run_report_json_round_trip() -> None:
    report = measure(_hand_made())
    report.labels["kind"] = "art"
    again = RunReport.from_dict(report.to_dict())
    assert again == report


def _groups_at_versions(versions: list[int]) -> list[Any]:
    import art

    return [
        art.TrajectoryGroup(
            [art.Trajectory(reward=r, initial_policy_version=v) for r in (0.0, 1.0)],
            metadata={"scenario_id": i},
        )
        for i, v in enumerate(versions)
    ]


# --- the doubles in virtual time --------------------------------------------------------------


def _tiny(**kw: Any) -> Workload:
    base: dict[str, Any] = dict(
        name="tiny",
        workers=2,
        rollout_latency=Constant(0.05),
        train_time=Constant(0.1),
        min_batch=2,
        max_batch=2,
        max_steps_off_policy=1,
        steps=3,
        eval_time=0.25,
    )
    base.update(kw)
    return Workload(**base)


async def _exercise(workload: Workload, rec: Recorder) -> list[Any]:
    """Two rollouts in parallel, then one train step and one eval, as a trainer would."""
    backend = SyntheticBackend(workload.train_time, rec)
    rollout = make_rollout_fn(workload, rec)
    evaluate = make_eval_fn(workload, rec)
    assert evaluate is not None
    groups: list[Any] = []

    async def one(scenario: dict[str, Any]) -> None:
        groups.append(await rollout(None, scenario, None))

    async with anyio.create_task_group() as tg:
        for scenario in scenarios(2):
            tg.start_soon(one, scenario)
    for g in groups:
        for t in g.trajectories:
            t.initial_policy_version = 0
    result = await backend.train(None, groups)
    assert result.step == 1 and await backend._get_step(None) == 1
    await evaluate(None, 1, None)
    return groups


def test_doubles_run_in_trio_virtual_time() -> None:
    rec = Recorder()
    clock = trio.testing.MockClock(autojump_threshold=0)
    groups = trio.run(_exercise, _tiny(), rec, clock=clock)
    # Virtual time: durations are exact.
    assert [rec.rollout_end[i] - rec.rollout_start[i] for i in (0, 1)] == [0.05, 0.05]
    (step,) = rec.steps
    assert step.end - step.start == pytest.approx(0.1)
    assert step.start == pytest.approx(0.05)
    assert rec.evals[0][2] - rec.evals[0][1] == pytest.approx(0.25)
    assert sorted(g.metadata["scenario_id"] for g in groups) == [0, 1]
    rewards = [t.reward for t in groups[0].trajectories]
    assert len(set(rewards)) == len(rewards)  # non-identical rewards
    assert measure(rec).utilization == pytest.approx(1.0)


def test_cancelled_rollout_is_recorded() -> None:
    rec = Recorder()

    async def go() -> None:
        rollout = make_rollout_fn(_tiny(rollout_latency=Constant(1.0)), rec)
        with trio.move_on_after(0.25):
            await rollout(None, {"id": 3}, None)

    trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    assert rec.cancelled == 1 and rec.completed == 0
    assert rec.rollout_outcome[3] == "cancelled"
    assert rec.rollout_end[3] - rec.rollout_start[3] == pytest.approx(0.25)


def test_doubles_run_under_asyncio() -> None:
    rec = Recorder()
    anyio.run(
        _exercise,
        _tiny(rollout_latency=Constant(0.0), train_time=Constant(0.0), eval_time=0.0),
        rec,
        backend="asyncio",
    )
    assert rec.completed == 2 and len(rec.steps) == 1


def test_zero_variance_and_failure_draws() -> None:
    async def go(workload: Workload, rec: Recorder) -> list[Any]:
        rollout = make_rollout_fn(workload, rec)
        out: list[Any] = []
        for scenario in scenarios(20):
            try:
                out.append(await rollout(None, scenario, None))
            except RolloutFailed:
                out.append(None)
        return out

    rec = Recorder()
    flat = trio.run(go, _tiny(zero_variance_prob=1.0, rollout_latency=Constant(0.0)), rec)
    assert all(len({t.reward for t in g.trajectories}) == 1 for g in flat)
    assert rec.zero_variance == 20

    rec = Recorder()
    failed = trio.run(go, _tiny(failure_prob=1.0, rollout_latency=Constant(0.0)), rec)
    assert failed == [None] * 20 and rec.failed == 20

    rec = Recorder()
    mixed = trio.run(go, _tiny(failure_prob=0.5, rollout_latency=Constant(0.0), seed=5), rec)
    assert 0 < mixed.count(None) < 20


def test_same_scenario_same_latency_across_instances() -> None:
    workload = _tiny(rollout_latency=Exponential(0.05), seed=11)

    async def latencies() -> list[float]:
        rec = Recorder()
        rollout = make_rollout_fn(workload, rec)
        for scenario in reversed(list(scenarios(5))):
            await rollout(None, scenario, None)
        return [rec.rollout_end[i] - rec.rollout_start[i] for i in range(5)]

    clock = trio.testing.MockClock(autojump_threshold=0)
    first = trio.run(latencies, clock=clock)
    second = trio.run(latencies, clock=trio.testing.MockClock(autojump_threshold=0))
    assert first == pytest.approx(second)


def test_presets_match_the_issue() -> None:
    assert {
        "plenty-off1",
        "plenty-off2",
        "on-policy",
        "heavy-tail",
        "tight-off1",
        "defaults",
        "overhead-b32",
        "overhead-b1",
        "memory",
    } <= set(PRESETS)
    tight = PRESETS["tight-off1"]
    assert (tight.workers, tight.rollout_latency.mean, tight.max_steps_off_policy) == (32, 0.2, 1)
    defaults = PRESETS["defaults"]
    assert (defaults.min_batch, defaults.max_batch, defaults.max_steps_off_policy) == (4, 40, 4)
    assert PRESETS["memory"].scenarios == 100_000


# --- harness ----------------------------------------------------------------------------------


def test_art_trainer_runs_on_the_doubles() -> None:
    """ART's own trainer, 3 instant steps: the harness wiring works (about 1 s: ART's exit)."""
    workload = _tiny(
        rollout_latency=Constant(0.0), train_time=Constant(0.0), eval_time=None, workers=4
    )
    report = run_one("art", workload)
    assert report.steps == 3 and report.groups == 6
    assert set(report.staleness) <= {0, 1}
    assert report.labels["kind"] == "art"


def test_cli_parsing_and_tables() -> None:
    args = build_parser().parse_args(
        [
            "--workloads",
            "scheduling,memory",
            "--kinds",
            "art,trio",
            "--seeds",
            "0,1",
            "--sweep",
            "off",
        ]
    )
    assert args.workloads[-1] == "memory" and len(args.workloads) == 8
    assert args.sweep == [] and args.seeds == [0, 1]
    report = measure(_hand_made())
    art_cell = Cell("art", "plenty-off1", {}, [report])
    trio_cell = Cell("trio", "plenty-off1", {}, [report])
    table = main_table([art_cell, trio_cell], ["plenty-off1"], ["art", "trio"])
    assert "(1.00x)" in table and "plenty-off1" in table
    sweep = sweep_table(
        [Cell("trio", "plenty-off1", {KNOB: 4}, [report])], [art_cell], ["plenty-off1"]
    )
    assert f"{KNOB}=4" in sweep
    assert format_staleness({0: 1, 1: 3}) == "0:25% 1:75%"


def test_art_child_runs_without_trio_asyncio(tmp_path: Any) -> None:
    """The art kind's child never imports art_trio's __init__ (whose trio_asyncio import
    patches asyncio.new_event_loop), so ART runs on a plain asyncio loop."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import art_trio.bench.child as child

    spec = {
        "kind": "art",
        "workload": "overhead-b1",
        "overrides": {"steps": 3},
        "points": [{}],
    }
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    subprocess.run(
        [sys.executable, str(Path(child.__file__)), str(spec_path), str(out_path)],
        check=True,
        capture_output=True,
        env=env,
        timeout=120,
    )
    (result,) = json.loads(out_path.read_text())
    labels = result["report"]["labels"]
    assert labels["trio_asyncio_imported"] is False
    assert "trio_asyncio" not in labels["event_loop"]
    assert result["report"]["steps"] == 3
