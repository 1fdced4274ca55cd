"""Behaviour 8: evals at step 0 and every n steps, one at a time, in the background."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import art

from art_trio import PipelineTrainer
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory


def rows(model: Any) -> list[dict[str, Any]]:
    path = Path(model._get_output_dir()) / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_eval_at_step_0_then_every_n_steps_one_at_a_time(model, autojump_clock):
    backend = RecordingBackend(train_seconds=1.0)
    object.__setattr__(model, "_backend", backend)
    running = 0
    overlaps = 0
    evaluated: list[int] = []
    steps_trained_during_eval: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        nonlocal running, overlaps
        running += 1
        overlaps += running > 1
        before = backend.step
        await asyncio.sleep(2.5)  # longer than a step: training goes on meanwhile
        steps_trained_during_eval.append(backend.step - before)
        running -= 1
        evaluated.append(step)
        return [trajectory(0.25), trajectory(0.75)]

    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(12), None, eval_fn,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    ).train(handle_signals=False)
    assert evaluated == [0, 2, 4, 6]
    assert overlaps == 0
    assert max(steps_trained_during_eval) >= 1  # evals ran in the background of training
    val = {r["step"]: r for r in rows(model) if "val/reward" in r}
    assert sorted(val) == [0, 2, 4, 6]
    assert val[2]["val/reward"] == 0.5
    assert val[2]["time/step_eval_s"] == 2.5


async def test_eval_step_0_false_and_eval_at_start_false_skip_step_0(model, backend):
    evaluated: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        evaluated.append(step)
        return [trajectory(1.0)]

    for kwargs in ({"eval_step_0": False}, {"eval_at_start": False}):
        evaluated.clear()

        await PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(4), None, eval_fn, resume=False,
            num_rollout_workers=1, min_batch_size=2, max_batch_size=2, eval_every_n_steps=1,
            **kwargs,
        ).train(handle_signals=False)
        assert 0 not in evaluated


async def test_a_dict_result_logs_each_split(model, backend):
    async def eval_fn(model: Any, step: int, config: Any) -> dict[str, list[Any]]:
        return {
            "val": [trajectory(1.0), art.TrajectoryGroup([trajectory(0.0), trajectory(0.5)])],
            "test": [trajectory(0.2)],
        }

    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(2), None, eval_fn,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    step0 = [r for r in rows(model) if r["step"] == 0]
    assert any(r.get("val/reward") == 0.5 for r in step0)
    assert any(r.get("test/reward") == 0.2 for r in step0)
    for split in ("val", "test"):
        assert (Path(model._get_output_dir()) / "trajectories" / split / "0000.parquet").exists()


async def test_an_eval_that_raises_warns_and_training_goes_on(model, backend, caplog):
    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        raise ConnectionError("eval server down")

    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(6), None, eval_fn,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2, eval_every_n_steps=1,
    ).train(handle_signals=False)
    assert backend.step == 3
    out = caplog.text
    assert "eval at step 0 failed (builtins.ConnectionError): eval server down" in out


async def test_the_last_scheduled_eval_runs_before_train_returns(model, autojump_clock):
    backend = RecordingBackend()
    object.__setattr__(model, "_backend", backend)
    evaluated: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        await asyncio.sleep(30)
        evaluated.append(step)
        return [trajectory(1.0)]

    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(4), None, eval_fn,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
        eval_step_0=False,
    ).train(handle_signals=False)
    assert evaluated == [2]
