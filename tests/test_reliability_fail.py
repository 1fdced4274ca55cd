"""Failures: a stage that raises, and bad input, never hang a run or lose what was done.

What a user may rely on:

- an exception in any stage cancels the other stages promptly, the state is persisted, and
  the error reaches the caller inside an ExceptionGroup (as task groups raise), with a note
  "raised in art_trio's <stage> stage"; nothing the trainer started is left running (no
  task, no thread, no trio-asyncio loop);
- bad constructor values raise ValueError naming the parameter;
- a rollout that raises, returns something that is not a TrajectoryGroup, or returns a
  non-finite reward is counted as errored, named in a printed line (exception type and
  scenario id), never sent to the backend, and the run goes on;
- a scenario iterator that raises, a `backend.train` that raises, or ART's own `model.log`
  raising inside the training stage stops the run with that error (ART's trainer hangs
  forever on the last one); after a failed `backend.train` a resumed run trains the same
  scenarios again;
- an `eval_fn` that raises prints a warning and training goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import art
import art.model
import pytest
import trio
import trio.testing
import trio_asyncio

from art_trio import EvalEnded, PipelineTrainer
from art_trio.messages.types import EvalResult
from art_trio.resume.store import StateStore
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory
from tests.errors import find_leaf
from tests.loops import sidecar

# -- helpers -------------------------------------------------------------------------------


def _trainer(
    model: art.TrainableModel,
    backend: RecordingBackend,
    rollout_fn: Any,
    source: Any = None,
    **kwargs: Any,
) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 4,
        "min_batch_size": 2,
        "max_batch_size": 4,
        "eval_step_0": False,
    }
    options.update(kwargs)
    return PipelineTrainer(
        model,
        backend,
        rollout_fn,
        scenarios(200) if source is None else source,
        None,
        **options,
    )


def _resolved(state: dict[str, Any]) -> set[int]:
    return set(range(state["scenario_offset"])) | set(state["resolved_scenarios"])


def _live_tasks() -> set[trio.lowlevel.Task]:
    """Every task of the running trio program (walks the task tree from the root)."""
    found: set[trio.lowlevel.Task] = set()
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None or task in found:
            continue
        found.add(task)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return found


# -- a stage that raises --------------------------------------------------------------------


async def test_a_failing_stage_cancels_the_others_and_leaves_nothing_behind(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """backend.train raises while hour-long rollouts are in flight: they are cancelled at
    once (their finally blocks run), and no task, thread or trio-asyncio loop survives."""
    started: list[int] = []
    finalized: list[int] = []

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        if scenario["i"] < 2:
            return await asyncio_rollout(model, scenario, config)
        started.append(scenario["i"])
        try:
            await asyncio.sleep(3600)
            raise AssertionError("an hour-long rollout was not cancelled")
        finally:
            finalized.append(scenario["i"])

    backend.fail_on_step = 1
    trainer = _trainer(model, backend, rollout, max_batch_size=2)
    tasks_before = _live_tasks()
    threads_before = set(threading.enumerate())
    assert trio_asyncio.current_loop.get() is None
    started_at = trio.current_time()
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await trainer.train(handle_signals=False)

    assert trio.current_time() - started_at < 10.0
    leaf, notes = find_leaf(excinfo.value, RuntimeError)
    assert "backend exploded at step 1" in str(leaf)
    assert any("training stage" in note for note in notes), notes
    assert started, "the test needs rollouts in flight when the stage fails"
    assert sorted(finalized) == sorted(started)
    assert _live_tasks() == tasks_before
    # No thread started by the run survives it (threads other tests left may end meanwhile:
    # asyncio.run() under trio-asyncio's patches runs a helper thread that exits lazily).
    assert set(threading.enumerate()) - threads_before == set()
    assert trio_asyncio.current_loop.get() is None
    # Persisted: the batch handed to the backend is pending, nothing is resolved.
    state = sidecar(model)
    assert state["pending_batch"] == {"step": 1, "scenario_indices": [0, 1]}
    assert _resolved(state) == set()


async def test_backend_train_failure_is_retrained_on_resume_none_skipped(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    backend.fail_on_step = 3
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, asyncio_rollout).train(handle_signals=False)
    leaf, notes = find_leaf(excinfo.value, RuntimeError)
    assert "backend exploded at step 3" in str(leaf)
    assert any("training stage" in note for note in notes), notes
    state = sidecar(model)
    failed_batch = state["pending_batch"]
    assert failed_batch is not None and failed_batch["step"] == 3
    first_run = backend.trained_ids
    assert backend.step == 2
    assert _resolved(state) == set(first_run)

    backend.fail_on_step = None
    await _trainer(model, backend, asyncio_rollout, max_steps=3).train(handle_signals=False)
    trained = backend.trained_ids
    assert len(trained) == len(set(trained)), "a scenario was trained twice"
    assert set(failed_batch["scenario_indices"]) <= set(trained[len(first_run):])
    final = sidecar(model)
    assert final["pending_batch"] is None
    # None skipped: everything under the watermark was trained (no discards in this run).
    assert set(range(final["scenario_offset"])) <= set(trained)


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_a_scenario_iterator_that_raises_stops_the_run_with_its_error(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    kind: str,
) -> None:
    items = scenarios(30)

    def sync_source() -> Iterator[dict[str, Any]]:
        yield from items
        raise LookupError("scenario store went away")

    async def asyncio_source() -> AsyncIterator[dict[str, Any]]:
        for item in items:
            await asyncio.sleep(0)  # asyncio code: runs through the bridge under trio
            yield item
        raise LookupError("scenario store went away")

    source = sync_source() if kind == "sync" else asyncio_source()
    # One worker and batches of 2: several steps train before the iterator fails.
    trainer = _trainer(
        model, backend, asyncio_rollout, source, num_rollout_workers=1, max_batch_size=2,
        min_batch_size=1,
    )
    with trio.fail_after(600), pytest.raises(BaseExceptionGroup) as excinfo:
        await trainer.train(handle_signals=False)
    leaf, notes = find_leaf(excinfo.value, LookupError)
    assert "scenario store went away" in str(leaf)
    assert any("rollout stage" in note for note in notes), notes
    # Persisted: once resume settles the pending batch against the backend's step (the
    # failure may have cancelled backend.train, or model.log after it), exactly what was
    # trained is resolved.
    trained = backend.trained_ids
    assert trained, "the test needs steps trained before the failure"
    state = StateStore(model._get_output_dir()).read()
    assert state is not None
    state.ledger.settle_pending(backend.step)
    resolved = {i for i in range(max(trained) + 10) if state.ledger.is_resolved(i)}
    assert resolved == set(trained)


async def test_model_log_raising_in_the_training_stage_ends_the_run(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ART's trainer hangs forever here; art_trio must end with the error."""

    def broken_parquet_writer(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full while writing trajectories")

    monkeypatch.setattr(art.model, "write_trajectory_groups_parquet", broken_parquet_writer)
    trainer = _trainer(model, backend, asyncio_rollout, max_steps_off_policy=1)
    tasks_before = _live_tasks()
    threads_before = set(threading.enumerate())
    with trio.fail_after(600), pytest.raises(BaseExceptionGroup) as excinfo:
        await trainer.train(handle_signals=False)
    leaf, notes = find_leaf(excinfo.value, OSError)
    assert "disk full" in str(leaf)
    assert any("training stage" in note for note in notes), notes
    assert _live_tasks() == tasks_before
    # No thread started by the run survives it (threads other tests left may end meanwhile:
    # asyncio.run() under trio-asyncio's patches runs a helper thread that exits lazily).
    assert set(threading.enumerate()) - threads_before == set()
    assert trio_asyncio.current_loop.get() is None
    # backend.train ran before model.log failed: the step is done, so resume counts it.
    assert backend.step == 1
    state = sidecar(model)
    assert state["pending_batch"]["step"] == 1


async def test_model_log_raising_ends_the_run_on_the_real_clock(
    model: art.TrainableModel, backend: RecordingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, without virtual time: a generous real timeout turns a hang into a failure."""

    def broken_parquet_writer(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full while writing trajectories")

    monkeypatch.setattr(art.model, "write_trajectory_groups_parquet", broken_parquet_writer)
    trainer = _trainer(model, backend, asyncio_rollout, max_steps_off_policy=1)
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup) as excinfo:
        await trainer.train(handle_signals=False)
    assert "disk full" in str(find_leaf(excinfo.value, OSError)[0])


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        ({"num_rollout_workers": 0}, "num_rollout_workers"),
        ({"min_batch_size": 0}, "min_batch_size"),
        ({"min_batch_size": 4, "max_batch_size": 2}, "max_batch_size"),
        ({"max_steps_off_policy": -1}, "max_steps_off_policy"),
        ({"queue_maxsize": 0}, "queue_maxsize"),
        ({"max_steps": -1}, "max_steps"),
        ({"shutdown_grace_seconds": -1.0}, "shutdown_grace_seconds"),
        ({"shutdown_grace_seconds": float("nan")}, "shutdown_grace_seconds"),
        ({"admission": "greedy"}, "admission"),
        ({"max_rollouts_beyond_bound": -1}, "max_rollouts_beyond_bound"),
        ({"checkpoint_retention_interval": 0}, "checkpoint_retention_interval"),
        ({"packed_sequence_length": 0}, "packed_sequence_length"),
    ],
)
def test_invalid_constructor_values_raise_value_error_naming_the_parameter(
    model: art.TrainableModel,
    backend: RecordingBackend,
    kwargs: dict[str, Any],
    parameter: str,
) -> None:
    with pytest.raises(ValueError, match=parameter):
        _trainer(model, backend, asyncio_rollout, **kwargs)


async def test_a_rollout_that_raises_is_counted_as_errored_and_the_run_goes_on(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        if scenario["i"] == 3:
            raise KeyError("tool server returned garbage")
        return await asyncio_rollout(model, scenario, config)

    trainer = _trainer(model, backend, rollout, max_steps=3)
    await trainer.train(handle_signals=False)
    assert backend.step == 3
    assert trainer.last_counters is not None and trainer.last_counters.errored == 1
    assert 3 not in backend.trained_ids
    lines = [line for line in caplog.text.splitlines() if "KeyError" in line]
    assert len(lines) == 1, lines
    assert "scenario_id=3" in lines[0]
    # Errored counts as resolved: a resumed run does not roll it again.
    assert 3 in _resolved(sidecar(model))


@pytest.mark.parametrize("returned", [None, [], "a group"], ids=["None", "list", "str"])
async def test_a_rollout_returning_a_non_group_is_counted_as_errored(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
    returned: Any,
) -> None:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        if scenario["i"] == 5:
            return returned
        return await asyncio_rollout(model, scenario, config)

    trainer = _trainer(model, backend, rollout, max_steps=3)
    await trainer.train(handle_signals=False)
    assert backend.step == 3
    assert trainer.last_counters is not None and trainer.last_counters.errored == 1
    assert 5 not in backend.trained_ids
    lines = [line for line in caplog.text.splitlines() if "scenario_id=5" in line]
    assert len(lines) == 1, lines
    assert type(returned).__name__ in lines[0] and "TrajectoryGroup" in lines[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_a_group_with_a_non_finite_reward_is_errored_and_never_trained(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
    bad: float,
) -> None:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        if scenario["i"] in (2, 7):
            return art.TrajectoryGroup([trajectory(0.0), trajectory(bad), trajectory(1.0)])
        return await asyncio_rollout(model, scenario, config)

    trainer = _trainer(model, backend, rollout, max_steps=4)
    await trainer.train(handle_signals=False)
    assert backend.step == 4
    assert trainer.last_counters is not None and trainer.last_counters.errored == 2
    trained_rewards = [r for call in backend.calls for group in call.rewards for r in group]
    assert all(abs(r) < float("inf") for r in trained_rewards)  # no NaN/inf reached train()
    assert not {2, 7} & set(backend.trained_ids)
    out = caplog.text
    for scenario_id in (2, 7):
        lines = [line for line in out.splitlines() if f"scenario_id={scenario_id}" in line]
        assert len(lines) == 1, lines
        assert "non-finite" in lines[0] and repr(bad) in lines[0]


async def test_an_eval_fn_that_raises_warns_and_training_goes_on(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> EvalResult:
        calls.append(step)
        raise ConnectionError(f"eval server down at step {step}")

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(200), None, eval_fn,
        num_rollout_workers=4, min_batch_size=2, max_batch_size=4, max_steps=4,
        eval_every_n_steps=1, eval_step_0=True,
    )
    await trainer.train(handle_signals=False)
    assert backend.step == 4
    assert 0 in calls and len(calls) >= 2
    warnings = [r for r in caplog.records if "ConnectionError" in r.getMessage()]
    assert len(warnings) == len(calls), warnings
    assert all(r.levelno == logging.WARNING for r in warnings), warnings


@pytest.mark.parametrize(
    "returned",
    [None, {"val": None}, 7, {"val": 7}, trajectory(1.0), {"val": trajectory(1.0)}],
    ids=["None", "a split of None", "an int", "a split of an int", "one trajectory",
         "a split of one trajectory"],
)
async def test_an_eval_fn_returning_no_list_is_empty_or_told_what_to_return(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
    returned: Any,
) -> None:
    """None is an empty eval, as in ART (an eval_fn that logs on its own), and one
    trajectory is a list of one: completed, no warning. Anything else that is no list fails
    that eval with a warning saying what an eval_fn returns; training goes on either way."""

    async def eval_fn(model: Any, step: int, config: Any) -> Any:
        return returned

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(200), None, eval_fn,
        num_rollout_workers=4, min_batch_size=2, max_batch_size=4, max_steps=2,
        eval_every_n_steps=1, eval_step_0=False,
    )
    ended: list[EvalEnded] = []
    trainer.add_observer(lambda e: ended.append(e) if isinstance(e, EvalEnded) else None)
    await trainer.train(handle_signals=False)
    assert backend.step == 2
    value = returned["val"] if isinstance(returned, dict) else returned
    fine = not isinstance(value, int)
    assert [(e.step, e.completed) for e in ended] == [(1, fine), (2, fine)]
    assert [e.reward for e in ended] == ([1.0, 1.0] if isinstance(value, art.Trajectory)
                                         else [None, None])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    told = [w for w in warnings if "eval_fn returned int; return a list of" in w]
    assert len(told) == (0 if fine else 2), warnings


async def test_a_trainer_whose_run_failed_can_train_again(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """A failed train() leaves the trainer usable: the next train() resumes and succeeds."""
    backend.fail_on_step = 1
    trainer = _trainer(model, backend, asyncio_rollout, max_steps=2)
    with pytest.raises(BaseExceptionGroup):
        await trainer.train(handle_signals=False)
    backend.fail_on_step = None
    await trainer.train(handle_signals=False)
    assert backend.step == 2


def test_train_works_under_a_fresh_trio_run_after_a_failure(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """No global state (trio-asyncio loop, signal handlers) leaks out of a failed run."""
    backend.fail_on_step = 1
    trainer = _trainer(model, backend, asyncio_rollout, max_steps=1)
    clock = trio.testing.MockClock(autojump_threshold=0)
    with pytest.raises(BaseExceptionGroup):
        trio.run(functools.partial(trainer.train, handle_signals=False), clock=clock)
    backend.fail_on_step = None
    trio.run(
        functools.partial(trainer.train, handle_signals=False),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert backend.step == 1
