"""Callbacks as ART takes them: anything callable that returns an awaitable.

ART's own tests pass `lambda *a, **k: coroutine(...)` as rollout_fn; users pass
`functools.partial` and objects with an async `__call__`. A callable whose result cannot be
awaited is a programming error: the run ends at its first call with an error naming it, and
the scenario it held stays unresolved (a resumed run rolls it again).
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import art
import pytest

from art_trio import CallbackNotAwaitable, PipelineTrainer, make_group_rollout_fn
from tests.doubles import asyncio_rollout, scenarios, trajectory


async def _rollout_with(model: Any, scenario: Any, config: Any, *, bonus: float) -> Any:
    return await asyncio_rollout(model, scenario, config)


class CallableRollout:
    async def __call__(self, model: Any, scenario: Any, config: Any) -> Any:
        return await asyncio_rollout(model, scenario, config)


_draws = itertools.count()


async def _single(model: Any, scenario: Any, config: Any) -> art.Trajectory:
    return trajectory(float(next(_draws) % 2))  # rewards vary within each group


CALLABLES = {
    "lambda": lambda *a, **k: asyncio_rollout(*a, **k),
    "partial": functools.partial(_rollout_with, bonus=1.0),
    "async __call__": CallableRollout(),
    "group of a lambda": make_group_rollout_fn(lambda *a: _single(*a), n=3),
}


@pytest.mark.parametrize("name", CALLABLES)
async def test_any_callable_returning_an_awaitable_is_a_rollout_fn(
    model: Any, backend: Any, name: str
) -> None:
    trainer = PipelineTrainer(
        model, backend, CALLABLES[name], scenarios(8), None,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
    )
    await trainer.train(handle_signals=False)
    assert trainer.last_counters is not None
    assert trainer.last_counters.errored == 0
    assert len(backend.calls) >= 2


def _not_awaitable(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])


def _resolved(model: Any) -> dict[str, Any]:
    state = json.loads((Path(model._get_output_dir()) / "state.json").read_text())
    record: dict[str, Any] = state["_pipeline_trainer"]
    return record


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize(
    "rollout_fn",
    [_not_awaitable, make_group_rollout_fn(lambda *a: trajectory(1.0), n=2)],
    ids=["rollout_fn", "single rollout of a group"],
)
async def test_a_non_awaitable_result_ends_the_run_naming_the_function(
    model: Any, backend: Any, rollout_fn: Any, workers: int
) -> None:
    """Said once, however many workers met it at once."""
    trainer = PipelineTrainer(
        model, backend, rollout_fn, scenarios(6), None, num_rollout_workers=workers,
        min_batch_size=2, max_batch_size=2,
    )
    with pytest.raises(ExceptionGroup) as caught:
        await trainer.train(handle_signals=False)
    assert len(caught.value.exceptions) == 1
    error = caught.value.exceptions[0]
    assert isinstance(error, CallbackNotAwaitable)
    assert "cannot be awaited" in str(error) and "async def" in str(error)
    if rollout_fn is _not_awaitable:
        assert "_not_awaitable returned TrajectoryGroup" in str(error)
    assert backend.calls == []
    # Nothing resolved: the scenario the worker held rolls again on resume.
    record = _resolved(model)
    assert record["scenario_offset"] == 0 and record["resolved_scenarios"] == []
    assert trainer.last_counters is not None and trainer.last_counters.errored == 0


async def test_a_non_awaitable_eval_fn_ends_the_run_too(model: Any, backend: Any) -> None:
    def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(1.0)]

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(6), None, eval_fn,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    with pytest.raises(ExceptionGroup) as caught:
        await trainer.train(handle_signals=False)
    assert isinstance(caught.value.exceptions[0], CallbackNotAwaitable)
    assert "eval_fn" in str(caught.value.exceptions[0]) or "returned list" in str(
        caught.value.exceptions[0]
    )


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "4"])
def test_make_group_rollout_fn_refuses_a_group_size_that_is_no_count(n: Any) -> None:
    """ART's helper makes empty groups of n <= 0 (every one discarded, nothing trained) and
    fails at the first rollout on a float; refused here, when the helper is made."""
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        make_group_rollout_fn(_single, n=n)


def test_make_group_rollout_fn_refuses_what_cannot_be_called() -> None:
    with pytest.raises(TypeError, match="single_rollout_fn must be an async function"):
        make_group_rollout_fn("rollout")  # type: ignore[arg-type]
