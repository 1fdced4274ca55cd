"""What ART 0.5.18's trainer added after the reference, under the same names in art_trio.

eval_at_start, packed_sequence_length, adapter leases and pruning, completed_eval_steps and
resume, checkpoint events in history.jsonl, the "discarded" split cap, rollout failure lines.
Checkpoint retention has its own file (test_retention.py); the side-by-side run against ART's
own trainer is test_differential_art.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio import PipelineTrainer, trio_native
from art_trio.plumbing.compat import CHECKPOINT_ROW_WALL_CLOCK, trainable_model
from art_trio.resume.store import StateStore
from tests.doubles import RecordingBackend, scenarios, trajectory

# -- a backend with ART 0.5.18's optional adapter hooks ------------------------------------

# Like LocalBackend's `pin_inference_step`: the lease pins, in the context of the task that
# entered it, the step `model.get_inference_name()` answers with.
_PINNED: ContextVar[tuple[tuple[str, int], ...]] = ContextVar("pinned_inference_steps", default=())


@dataclass
class LeasingBackend(RecordingBackend):
    """RecordingBackend + `adapter_lease` and `prune_model_adapters` as LocalBackend has them.

    The lease sets a context variable and resets it on exit, so a lease left in a different
    asyncio task than the one that entered it fails (ValueError), as LocalBackend's does.
    """

    active_leases: dict[int, int] = field(default_factory=dict)
    leases_taken: list[int] = field(default_factory=list)
    prune_calls: list[set[int]] = field(default_factory=list)

    @asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        asyncio.get_running_loop()
        self.leases_taken.append(step)
        self.active_leases[step] = self.active_leases.get(step, 0) + 1
        token = _PINNED.set((*_PINNED.get(), (model.name, step)))
        try:
            yield
        finally:
            _PINNED.reset(token)
            self.active_leases[step] -= 1
            if not self.active_leases[step]:
                del self.active_leases[step]

    def exact_adapter_lease(self, model: Any, step: int) -> Any:
        """ART 0.5.20's eval lease (the served weights are exactly `step`'s): the same here."""
        return self.adapter_lease(model, step)

    async def prune_model_adapters(self, model: Any, *, retain_steps: set[int]) -> None:
        asyncio.get_running_loop()
        self.prune_calls.append(set(retain_steps))

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        if step is None:
            step = dict(_PINNED.get()).get(model.name, self.step)
        return f"{model.name}@{step}"


def new_model(root: Path, backend: Any) -> art.TrainableModel:
    model = trainable_model(
        name="m", project="p", base_model="test-base", base_path=str(root / ".art")
    )
    asyncio.run(model.register(backend))
    return model


def run_sync(trainer: PipelineTrainer[Any, Any], loop: str) -> None:
    """Run `trainer.train()` to the end under trio or under asyncio (anyio's backend)."""
    train = functools.partial(trainer.train, handle_signals=False)
    if loop == "trio":
        trio.run(train)
    else:
        anyio.run(train, backend="asyncio")


def history(model: art.TrainableModel) -> list[dict[str, Any]]:
    path = Path(model._get_output_dir()) / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def leasing() -> LeasingBackend:
    return LeasingBackend()


@pytest.fixture
def leasing_model(tmp_path: Path, leasing: LeasingBackend) -> art.TrainableModel:
    return new_model(tmp_path, leasing)


def eval_completed_steps(model: art.TrainableModel) -> list[int]:
    return [row["step"] for row in history(model) if "checkpoint/eval_completed" in row]


async def two_rewards(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])


async def one_eval(model: Any, step: int, config: Any) -> list[art.Trajectory]:
    return [trajectory(step / 10)]


# -- eval_at_start ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "resolved"),
    [
        ({}, True),
        ({"eval_at_start": False}, False),
        ({"eval_at_start": True}, True),
        ({"eval_step_0": False}, False),
        ({"eval_step_0": False, "eval_at_start": False}, False),
        ({"eval_step_0": True, "eval_at_start": True}, True),
    ],
)
def test_eval_at_start_is_the_newer_name_of_eval_step_0(
    model: Any, backend: Any, kwargs: dict[str, Any], resolved: bool
) -> None:
    trainer = PipelineTrainer(model, backend, two_rewards, [], None, **kwargs)
    assert trainer.eval_at_start is resolved


def test_eval_step_0_false_with_eval_at_start_true_is_a_value_error(
    model: Any, backend: Any
) -> None:
    with pytest.raises(ValueError, match="eval_at_start and eval_step_0 disagree"):
        PipelineTrainer(
            model, backend, two_rewards, [], None, eval_step_0=False, eval_at_start=True
        )


def test_explicit_eval_step_0_true_cannot_be_told_from_its_default(
    model: Any, backend: Any
) -> None:
    """The documented limitation: eval_step_0 defaults to True (the reference's default), so
    eval_step_0=True with eval_at_start=False is indistinguishable from eval_at_start=False
    alone; the newer name wins and no error is raised."""
    trainer = PipelineTrainer(
        model, backend, two_rewards, [], None, eval_step_0=True, eval_at_start=False
    )
    assert trainer.eval_at_start is False


@pytest.mark.parametrize("eval_at_start", [True, False])
async def test_eval_at_start_decides_whether_step_0_is_evaluated(
    model: Any, backend: Any, eval_at_start: bool
) -> None:
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(4), None, one_eval,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=0,
        eval_at_start=eval_at_start,
    ).train(handle_signals=False)
    assert eval_completed_steps(model) == ([0] if eval_at_start else [])


# -- packed_sequence_length ------------------------------------------------------------------


@pytest.mark.parametrize("packed", [None, 4096])
async def test_packed_sequence_length_reaches_backend_train_only_when_set(
    model: Any, backend: Any, packed: int | None
) -> None:
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(4), None,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
        packed_sequence_length=packed,
    ).train(handle_signals=False)
    assert len(backend.calls) == 2
    for call in backend.calls:
        if packed is None:
            assert "packed_sequence_length" not in call.kwargs
        else:
            assert call.kwargs["packed_sequence_length"] == packed


# -- adapter leases and pruning ----------------------------------------------------------------


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_rollouts_and_evals_sample_from_the_step_they_lease(tmp_path: Path, loop: str) -> None:
    """The lease is held in the callback's own asyncio task, as ART holds it.

    LocalBackend's lease pins the step `model.get_inference_name()` answers with in the
    entering task's context; entered in another task, the pin misses the rollout and leaving
    it raises ValueError ("created in a different Context").
    """
    backend = LeasingBackend()
    model = new_model(tmp_path, backend)
    sampled_evals: dict[int, str] = {}

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.sleep(0)
        group = art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])
        group.metadata["sampled"] = model.get_inference_name()
        return group

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        sampled_evals[step] = model.get_inference_name()
        return [trajectory(0.5)]

    seen: list[tuple[Any, int]] = []
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        for group in groups:
            version = min(t.initial_policy_version for t in group.trajectories)
            seen.append((group.metadata["sampled"], version))
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(12), None, eval_fn,
        num_rollout_workers=3, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    )
    run_sync(trainer, loop)
    counters = trainer.last_counters
    assert counters is not None and counters.errored == 0
    assert len(seen) == counters.trained > 0
    assert all(sampled == f"m@{version}" for sampled, version in seen), seen
    assert sampled_evals == {step: f"m@{step}" for step in range(0, backend.step + 1, 2)}
    assert not backend.active_leases
    assert len(backend.leases_taken) == counters.rollouts_started + len(sampled_evals)


async def test_trio_native_callbacks_hold_the_lease_for_their_whole_duration(
    leasing_model: Any, leasing: LeasingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """A trio-native callback cannot run in the lease's asyncio task; the lease is still held
    (entered and left in one asyncio task) from before the callback starts until it ends."""
    model, backend = leasing_model, leasing
    backend.train_seconds = 1.0
    held: dict[Any, tuple[set[int], set[int]]] = {}
    evals_held: dict[int, tuple[set[int], set[int]]] = {}

    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        before = set(backend.active_leases)
        await trio.sleep(2)
        held[scenario["metadata"]["scenario_id"]] = (before, set(backend.active_leases))
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    @trio_native
    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        before = set(backend.active_leases)
        await trio.sleep(3)
        evals_held[step] = (before, set(backend.active_leases))
        return [trajectory(0.5)]

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(8), None, eval_fn,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    )
    await trainer.train(handle_signals=False)
    assert len(backend.calls) == 4
    for call in backend.calls:
        for scenario_id, version in zip(call.scenario_ids, call.initial_versions, strict=True):
            before, after = held[scenario_id]
            assert version in before and version in after
    assert sorted(evals_held) == [0, 2, 4]
    for step, (before, after) in evals_held.items():
        assert step in before and step in after
    assert len(backend.leases_taken) == 8 + 3
    assert not backend.active_leases


async def test_leases_are_released_when_a_stop_cancels_rollouts_and_eval(
    leasing_model: Any, leasing: LeasingBackend, autojump_clock: trio.abc.Clock
) -> None:
    model, backend = leasing_model, leasing
    trainer: PipelineTrainer[Any, Any]

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] >= 4:
            await asyncio.sleep(1000)
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        if step == 2:
            trainer.request_stop()
            await asyncio.sleep(1000)
        return [trajectory(0.5)]

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(10), None, eval_fn,
        num_rollout_workers=3, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
        shutdown_grace_seconds=5,
    )
    await trainer.train(handle_signals=False)
    assert 2 in backend.leases_taken  # the eval at step 2 started, then was cancelled
    assert not backend.active_leases


async def test_prune_model_adapters_keeps_the_steps_rollouts_may_still_sample(
    leasing_model: Any, leasing: LeasingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """After each step s, the adapters of steps s-2 .. s stay (max_steps_off_policy=2).

    Virtual time: on the real clock a loaded machine could make a group stale, and then
    fewer steps train."""
    model, backend = leasing_model, leasing
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(12), None,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps_off_policy=2,
    ).train(handle_signals=False)
    assert len(backend.calls) == 6
    assert backend.prune_calls == [
        set(range(max(0, step - 2), step + 1)) for step in range(1, 7)
    ]


# -- completed_eval_steps and resume ---------------------------------------------------------


def pipeline_state(model: art.TrainableModel) -> dict[str, Any]:
    """What a resumed run would read (snapshot + journal; state.json mirrors snapshots only)."""
    state = StateStore(model._get_output_dir()).read()
    assert state is not None
    return state.to_json()


async def test_an_eval_a_stop_interrupted_runs_again_after_resume(
    model: Any, backend: Any, autojump_clock: trio.abc.Clock
) -> None:
    trainer: PipelineTrainer[Any, Any]

    @trio_native
    async def interrupted_eval(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        if step == 2:
            trainer.request_stop()
            await trio.sleep_forever()
        return [trajectory(0.5)]

    kwargs: dict[str, Any] = dict(
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
        shutdown_grace_seconds=1,
    )
    trainer = PipelineTrainer(
        model, backend, two_rewards, scenarios(12), None, interrupted_eval, **kwargs
    )
    await trainer.train(handle_signals=False)
    stopped_at = backend.step
    assert eval_completed_steps(model) == [0]
    state = pipeline_state(model)
    assert state["completed_eval_steps"] == [0]
    # Step 2's eval was cancelled; any later eval step had not started.
    interrupted = list(range(2, stopped_at + 1, 2))
    assert state["pending_eval_steps"] == interrupted

    evaluated: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        evaluated.append(step)
        return [trajectory(0.5)]

    resumed = PipelineTrainer(model, backend, two_rewards, scenarios(12), None, eval_fn, **kwargs)
    await resumed.train(handle_signals=False)
    assert backend.step == 6
    # The interrupted evals come first; step 0 is not evaluated again.
    assert evaluated == interrupted + [s for s in range(stopped_at + 1, 7) if s % 2 == 0]
    assert pipeline_state(model)["completed_eval_steps"] == [0, 2, 4, 6]
    assert pipeline_state(model)["pending_eval_steps"] == []


async def test_a_completed_eval_is_persisted_at_once(
    model: Any, backend: Any, autojump_clock: trio.abc.Clock
) -> None:
    """ART writes completed_eval_steps as soon as an eval finishes; so does art_trio.

    Rollouts for step 3 wait until step 2's eval is in history.jsonl and then read the
    persisted state: nothing else persists in between (no step runs).
    """
    seen: list[list[int]] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] >= 4:
            for _ in range(1000):
                if 2 in eval_completed_steps(model):
                    break
                await asyncio.sleep(1)
            seen.append(pipeline_state(model)["completed_eval_steps"])
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    await PipelineTrainer(
        model, backend, rollout, scenarios(6), None, one_eval,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
        eval_at_start=False,
    ).train(handle_signals=False)
    assert backend.step == 3
    assert seen == [[2], [2]]


async def test_a_resumed_run_does_not_evaluate_its_start_step_again(
    model: Any, backend: Any
) -> None:
    kwargs: dict[str, Any] = dict(
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    )
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(6), None, one_eval, max_steps=1, **kwargs
    ).train(handle_signals=False)
    assert eval_completed_steps(model) == [0]
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(6), None, one_eval, **kwargs
    ).train(handle_signals=False)
    # ART 0.5.18 would evaluate step 1 here (the step it resumes at) and then 3, not 2.
    assert eval_completed_steps(model) == [0, 2]


async def test_a_fresh_run_evaluates_its_start_step_whatever_it_is(
    model: Any, backend: Any
) -> None:
    """A model already trained elsewhere (no pipeline state) gets its baseline eval."""
    backend.step = 5
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(4), None, one_eval,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    ).train(handle_signals=False)
    assert eval_completed_steps(model) == [5, 7]


async def test_a_failed_eval_is_not_retried_and_releases_its_checkpoint(
    model: Any, backend: Any
) -> None:
    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        if step == 2:
            raise RuntimeError("eval broke")
        return [trajectory(0.5)]

    await PipelineTrainer(
        model, backend, two_rewards, scenarios(8), None, eval_fn,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    ).train(handle_signals=False)
    state = pipeline_state(model)
    assert state["completed_eval_steps"] == [0, 4]
    assert state["pending_eval_steps"] == []


# -- checkpoint events in history.jsonl ----------------------------------------------------


async def test_checkpoint_events_are_appended_to_history_as_art_does(
    model: Any, backend: Any
) -> None:
    await PipelineTrainer(
        model, backend, two_rewards, scenarios(8), None, one_eval,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=2,
    ).train(handle_signals=False)
    out = Path(model._get_output_dir())
    saved = [row for row in history(model) if "checkpoint/saved" in row]
    assert [row["step"] for row in saved] == [2, 4]
    for row in saved:
        # ART 0.5.23 no longer stamps checkpoint rows with `time/wall_clock_sec`.
        assert set(row) == {
            "checkpoint/saved", "checkpoint/created_at_unix", "training_step",
            "step", "recorded_at",
        } | ({"time/wall_clock_sec"} if CHECKPOINT_ROW_WALL_CLOCK else set())
        assert row["checkpoint/saved"] == 1.0
        assert row["training_step"] == row["step"]
        path = out / "checkpoints" / f"{row['step']:04d}"
        assert row["checkpoint/created_at_unix"] == path.stat().st_ctime
    completed = [row for row in history(model) if "checkpoint/eval_completed" in row]
    assert [row["step"] for row in completed] == [0, 2, 4]
    assert all(row["checkpoint/eval_completed"] == 1.0 for row in completed)


# -- the "discarded" split -------------------------------------------------------------------


async def test_the_discarded_split_logs_at_most_50_groups_per_step(
    model: Any, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[tuple[str, int, int]] = []
    original_log = art.TrainableModel.log

    async def log(self: Any, trajectories: Any = None, split: str = "val", **kw: Any) -> None:
        if trajectories is not None:
            trajectories = list(trajectories)
            logged.append((split, kw["step"], len(trajectories)))
        await original_log(self, trajectories, split, **kw)

    monkeypatch.setattr(art.TrainableModel, "log", log)

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        # Scenarios 0..59 score the same on every rollout; 60 and 61 can be trained.
        rewards = [0.0, 1.0] if scenario["i"] >= 60 else [0.5, 0.5]
        return art.TrajectoryGroup([trajectory(r) for r in rewards])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(62), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    )
    await trainer.train(handle_signals=False)
    assert trainer.last_counters is not None and trainer.last_counters.zero_variance == 60
    assert [entry for entry in logged if entry[0] == "discarded"] == [("discarded", 1, 50)]


# -- rollout failure lines -------------------------------------------------------------------


async def test_a_rollout_failure_line_names_the_exception_type_and_the_scenario(
    model: Any, backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario.get("fail"):
            raise KeyError("no such tool")
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    work: list[Any] = [
        {"fail": True, "metadata": {"scenario_id": "q-7", "epoch": 2, "scenario_index": 7,
                                    "other": "not shown"}},
        {"fail": True, "metadata": {"epoch": 3}},
        {"fail": True},
        *scenarios(2),
    ]
    await PipelineTrainer(
        model, backend, rollout, work, None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    lines = [r.getMessage() for r in caplog.records if "rollout failed" in r.getMessage()]
    assert lines == [
        "Worker 0: rollout failed (builtins.KeyError): KeyError('no such tool')"
        " [scenario_id='q-7' epoch=2 scenario_index=7]",
        "Worker 0: rollout failed (builtins.KeyError): KeyError('no such tool') [epoch=3]",
        "Worker 0: rollout failed (builtins.KeyError): KeyError('no such tool')",
    ]


async def test_a_failing_trio_native_rollout_reports_its_own_exception_under_a_lease(
    leasing_model: Any, leasing: LeasingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease holder's task group must not turn the rollout's error into a group."""

    @trio_native
    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        if scenario["i"] == 0:
            raise KeyError("boom")
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    await PipelineTrainer(
        leasing_model, leasing, rollout, scenarios(3), None,
        num_rollout_workers=1, min_batch_size=2, max_batch_size=2,
    ).train(handle_signals=False)
    out = caplog.text
    assert "rollout failed (builtins.KeyError): KeyError('boom') [scenario_id=0]" in out
    assert len(leasing.calls) == 1
    assert not leasing.active_leases
