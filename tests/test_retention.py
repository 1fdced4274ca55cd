"""Checkpoint retention (ART 0.5.18's vocabulary): the strategy, what is protected, deletion.

Unit tests drive `apply_retention` with a stand-in run; the end-to-end tests run the trainer
in virtual time with slow rollouts and evals, and a backend that checks every deletion
against what it knows is in use.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import art
import art.pipeline_trainer.checkpoint_retention as art_retention
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import art_trio
from art_trio import (
    CheckpointInfo,
    CheckpointRetentionContext,
    PipelineSettings,
    PipelineTrainer,
    keep_recent_and_top,
)
from art_trio.plumbing.bridge.calls import Bridge
from art_trio.run import CallsInFlight
from art_trio.stages.checkpoints import apply_retention, checkpoint_infos
from tests.doubles import scenarios, trajectory
from tests.test_parity_0518 import LeasingBackend, new_model

# -- the public names ----------------------------------------------------------------------


def test_the_retention_names_are_exported_from_art_trio() -> None:
    for name in art_retention.__all__:
        assert name in art_trio.__all__, name
        assert hasattr(art_trio, name), name
    assert art_trio.CHECKPOINT_SAVED_METRIC == art_retention.CHECKPOINT_SAVED_METRIC
    assert art_trio.CHECKPOINT_CREATED_AT_METRIC == art_retention.CHECKPOINT_CREATED_AT_METRIC
    assert (
        art_trio.CHECKPOINT_EVAL_COMPLETED_METRIC
        == art_retention.CHECKPOINT_EVAL_COMPLETED_METRIC
    )


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (CheckpointInfo, art_retention.CheckpointInfo),
        (CheckpointRetentionContext, art_retention.CheckpointRetentionContext),
    ],
)
def test_the_types_have_arts_fields_and_defaults(ours: Any, theirs: Any) -> None:
    assert list(ours.model_fields) == list(theirs.model_fields)
    for name, theirs_field in theirs.model_fields.items():
        ours_field = ours.model_fields[name]
        assert _type_name(ours_field.annotation) == _type_name(theirs_field.annotation), name
        assert ours_field.get_default(call_default_factory=True) == theirs_field.get_default(
            call_default_factory=True
        ), name


def _type_name(annotation: Any) -> str:
    # list[art_trio.policy.retention.CheckpointInfo] and ART's list[...CheckpointInfo] read alike.
    return repr(annotation).replace(art_trio.CheckpointInfo.__module__ + ".", "").replace(
        art_retention.CheckpointInfo.__module__ + ".", ""
    )


def test_a_strategy_written_for_art_reads_art_trios_context() -> None:
    """A user's strategy typed against ART's classes works on art_trio's, and vice versa."""
    info = CheckpointInfo(step=3, path="/x/0003", created_at=datetime.now(UTC))
    context = CheckpointRetentionContext(current_step=4, checkpoints=[info])
    as_art = art_retention.CheckpointRetentionContext.model_validate(context.model_dump())
    assert as_art.model_dump() == context.model_dump()


@pytest.mark.parametrize(("kwargs", "message"), [({"recent": -1}, "recent"), ({"top": -1}, "top")])
def test_keep_recent_and_top_rejects_negative_counts_as_art_does(
    kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError) as ours:
        keep_recent_and_top(**kwargs)
    with pytest.raises(ValueError) as theirs:
        art_retention.keep_recent_and_top(**kwargs)
    assert str(ours.value) == str(theirs.value) == f"{message} must be >= 0"


checkpoint_lists = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=60),
        st.one_of(st.none(), st.sampled_from([0.0, 0.25, 0.5, 0.5, 1.0])),
        st.booleans(),
    ),
    max_size=12,
    unique_by=lambda item: item[0],
)


@given(
    checkpoints=checkpoint_lists,
    recent=st.integers(min_value=0, max_value=5),
    top=st.integers(min_value=0, max_value=4),
    metric=st.sampled_from(["val/reward", "test/score"]),
)
def test_keep_recent_and_top_keeps_what_arts_keeps(
    checkpoints: list[tuple[int, float | None, bool]], recent: int, top: int, metric: str
) -> None:
    infos = []
    for step, value, other_metric in checkpoints:
        metrics = {} if value is None else {metric: value}
        if other_metric:
            metrics["train/loss"] = 1.0
        infos.append(
            {
                "step": step,
                "path": f"/ckpt/{step:04d}",
                "created_at": datetime.fromtimestamp(step, UTC),
                "is_eval_step": value is not None,
                "metrics": metrics,
            }
        )
    ours = keep_recent_and_top(recent=recent, top=top, metric=metric)(
        CheckpointRetentionContext(current_step=61, checkpoints=infos)  # type: ignore[arg-type]
    )
    theirs = art_retention.keep_recent_and_top(recent=recent, top=top, metric=metric)(
        art_retention.CheckpointRetentionContext(
            current_step=61, checkpoints=infos  # type: ignore[arg-type]
        )
    )
    assert set(ours) == set(theirs)


# -- apply_retention with a stand-in run ---------------------------------------------------


@dataclass
class DeletingBackend:
    """Deletes checkpoint directories the way ART's backends do: keep a list, drop the rest."""

    output_dir: Path
    keep_lists: list[list[int]] = field(default_factory=list)

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        self.keep_lists.append(list(steps_to_keep))
        for path in (self.output_dir / "checkpoints").iterdir():
            if path.name.isdigit() and int(path.name) not in steps_to_keep:
                path.rmdir()


def stand_in_run(
    tmp_path: Path,
    steps: list[int],
    strategy: Any,
    *,
    interval: int = 1,
    leased: dict[int, int] | None = None,
    scheduled: set[int] | None = None,
    completed: set[int] | None = None,
    history: list[dict[str, Any]] | None = None,
    kl: dict[str, Any] | None = None,
) -> Any:
    """A run with checkpoints `steps` on disk; `kl` sets the KL penalty settings."""
    for step in steps:
        (tmp_path / "checkpoints" / f"{step:04d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "notes").mkdir(parents=True)  # not a step: ignored
    if history:
        (tmp_path / "history.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in history) + "{torn line\n"
        )
    seen: list[CheckpointRetentionContext] = []

    def recording(context: CheckpointRetentionContext) -> Any:
        seen.append(context)
        return strategy(context)

    run = SimpleNamespace(
        # The run's parts the checkpoint bookkeeping reads (run.PipelineRun).
        model=SimpleNamespace(_get_output_dir=lambda: str(tmp_path)),
        backend=DeletingBackend(tmp_path),
        bridge=Bridge(),
        settings=PipelineSettings.from_flat({
            "checkpoint_retention_strategy": recording,
            "checkpoint_retention_interval": interval,
            **(kl or {}),
        }),
        state=SimpleNamespace(
            completed_eval_steps=completed or set(), pending_eval_steps=scheduled or set()
        ),
        leases=SimpleNamespace(held=leased or {}),
        calls=CallsInFlight(time.monotonic),
        seen=seen,
    )
    return run


def keep_none(context: CheckpointRetentionContext) -> set[int]:
    return set()


async def test_current_leased_and_scheduled_checkpoints_are_never_offered_or_deleted(
    tmp_path: Path,
) -> None:
    run = stand_in_run(
        tmp_path, [1, 2, 3, 4, 5, 6], keep_none, leased={2: 1}, scheduled={4}
    )
    await apply_retention(run, 6)
    [context] = run.seen
    assert context.current_step == 6
    assert [c.step for c in context.checkpoints] == [1, 3, 5]
    assert run.backend.keep_lists == [[2, 4, 6]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "0002", "0004", "0006", "notes",
    ]


@pytest.mark.parametrize(
    ("kl", "steps", "current", "offered", "kept"),
    [
        # ART 0.5.23's default reference: step 0, whatever the strategy keeps.
        ({"kl_penalty_coef": 0.25}, [0, 1, 2, 3], 3, [1, 2], [0, 3]),
        # With a lag, the window from current - lag up (the references still to come).
        ({"kl_penalty_coef": 0.25, "kl_penalty_step_lag": 5}, list(range(7)), 6, [0],
         [1, 2, 3, 4, 5, 6]),
        ({"kl_penalty_coef": 0.25, "kl_penalty_step_lag": 2}, list(range(7)), 6, [0, 1, 2, 3],
         [4, 5, 6]),
        # art_trio's explicit reference step (both lines): that one step.
        ({"kl_penalty_coef": 0.25, "kl_penalty_reference_step": 2}, [0, 1, 2, 3], 3, [0, 1],
         [2, 3]),
        # No KL penalty: nothing extra is protected.
        ({"kl_penalty_coef": 0.0, "kl_penalty_step_lag": 2}, [0, 1, 2, 3], 3, [0, 1, 2], [3]),
    ],
    ids=["default-step-0", "lag-5", "lag-2", "explicit", "no-penalty"],
)
async def test_the_kl_reference_is_never_offered_or_deleted(
    tmp_path: Path,
    kl: dict[str, Any],
    steps: list[int],
    current: int,
    offered: list[int],
    kept: list[int],
) -> None:
    run = stand_in_run(tmp_path, steps, keep_none, kl=kl)
    await apply_retention(run, current)
    [context] = run.seen
    assert [c.step for c in context.checkpoints] == offered
    assert run.backend.keep_lists == [kept]


async def test_a_lag_window_covering_every_checkpoint_asks_nothing(tmp_path: Path) -> None:
    run = stand_in_run(
        tmp_path, [0, 1, 2, 3, 4], keep_none, kl={"kl_penalty_coef": 0.25, "kl_penalty_step_lag": 5}
    )
    await apply_retention(run, 4)
    assert run.seen == []
    assert run.backend.keep_lists == []


async def test_nothing_to_delete_means_no_backend_call(tmp_path: Path) -> None:
    run = stand_in_run(tmp_path, [1, 2, 3], lambda context: {1, 2, 99})
    await apply_retention(run, 3)
    assert len(run.seen) == 1
    assert run.backend.keep_lists == []


async def test_retention_runs_only_every_interval_steps(tmp_path: Path) -> None:
    run = stand_in_run(tmp_path, [1, 2, 3, 4, 5, 6], keep_none, interval=3)
    for step in (4, 5):
        await apply_retention(run, step)
    assert run.seen == []
    await apply_retention(run, 6)
    assert run.backend.keep_lists == [[6]]


async def test_no_strategy_deletes_nothing(tmp_path: Path) -> None:
    run = stand_in_run(tmp_path, [1, 2], keep_none)
    run.settings = run.settings.replace(checkpoint_retention_strategy=None)
    await apply_retention(run, 2)
    assert run.backend.keep_lists == []


def test_checkpoint_infos_read_metrics_and_eval_status_from_history(tmp_path: Path) -> None:
    created = time.time() - 1000
    run = stand_in_run(
        tmp_path,
        [1, 2, 3, 4],
        keep_none,
        completed={1},
        history=[
            {"step": 2, "val/reward": 0.5, "training_step": 2, "recorded_at": "x"},
            {"step": 2, "val/reward": 0.7},
            {"step": 3, art_trio.CHECKPOINT_EVAL_COMPLETED_METRIC: 1.0, "flag": True},
            {"step": 4, art_trio.CHECKPOINT_CREATED_AT_METRIC: created, "train/loss": 2.0},
        ],
    )
    infos = {info.step: info for info in checkpoint_infos(run)}
    assert sorted(infos) == [1, 2, 3, 4]
    assert [infos[s].is_eval_step for s in (1, 2, 3, 4)] == [True, True, True, False]
    assert infos[2].metrics == {"val/reward": pytest.approx(0.6), "training_step": 2.0}
    assert "flag" not in infos[3].metrics
    assert infos[4].created_at == datetime.fromtimestamp(created, UTC)
    assert infos[1].path == str(tmp_path / "checkpoints" / "0001")


# -- end to end, in virtual time -------------------------------------------------------------


@dataclass
class GuardedBackend(LeasingBackend):
    """Checks every deletion against the checkpoints it knows are in use."""

    awaiting_eval: set[int] = field(default_factory=set)
    violations: list[tuple[int, str]] = field(default_factory=list)
    held_while_deleting: dict[str, set[int]] = field(
        default_factory=lambda: {"lease": set(), "eval": set()}
    )
    retention_steps: list[int] = field(default_factory=list)

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
        result = await super().train(model, groups, **kwargs)
        if kwargs.get("save_checkpoint"):
            self.awaiting_eval.add(result.step)
        return result

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        directory = Path(model._get_output_dir()) / "checkpoints"
        existing = {int(p.name) for p in directory.iterdir()}
        doomed = existing - set(steps_to_keep)
        self.retention_steps.append(self.step)
        for step in doomed:
            if step == self.step:
                self.violations.append((step, "current"))
            if step in self.active_leases:
                self.violations.append((step, "leased"))
            if step in self.awaiting_eval:
                self.violations.append((step, "awaiting eval"))
        kept = existing - {self.step}
        self.held_while_deleting["lease"] |= kept & set(self.active_leases)
        self.held_while_deleting["eval"] |= kept & (self.awaiting_eval - set(self.active_leases))
        await super()._delete_checkpoint_files(model, steps_to_keep)


@pytest.fixture
def guarded() -> GuardedBackend:
    return GuardedBackend(train_seconds=5.0)


@pytest.fixture
def guarded_model(tmp_path: Path, guarded: GuardedBackend) -> art.TrainableModel:
    return new_model(tmp_path, guarded)


async def test_retention_never_deletes_a_checkpoint_in_use(
    guarded_model: Any, guarded: GuardedBackend, autojump_clock: trio.abc.Clock
) -> None:
    backend = guarded

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        # Every 4th rollout is slow: it holds its lease while training moves on.
        await asyncio.sleep(40 if scenario["i"] % 4 == 0 else 1)
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        # Slower than a step, so evals queue up behind each other.
        await asyncio.sleep(12)
        backend.awaiting_eval.discard(step)
        return [trajectory(step / 100)]

    await PipelineTrainer(
        guarded_model, backend, rollout, scenarios(40), None, eval_fn,
        num_rollout_workers=4, min_batch_size=2, max_batch_size=2, max_steps_off_policy=8,
        eval_every_n_steps=1, admission="eager",
        checkpoint_retention_strategy=keep_recent_and_top(recent=0, top=0),
    ).train(handle_signals=False)
    assert backend.step >= 15
    assert backend.violations == []
    assert len(backend.deleted_keep_lists) >= 5
    # The protections were exercised: deletions happened while in-use checkpoints existed.
    assert backend.held_while_deleting["lease"]
    assert backend.held_while_deleting["eval"]


async def test_retention_interval_end_to_end(
    guarded_model: Any, guarded: GuardedBackend
) -> None:
    backend = guarded
    backend.train_seconds = 0.0

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        backend.awaiting_eval.discard(step)
        return [trajectory(0.5)]

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    await PipelineTrainer(
        guarded_model, backend, rollout, scenarios(24), None, eval_fn,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_every_n_steps=1,
        checkpoint_retention_strategy=keep_recent_and_top(recent=1, top=0),
        checkpoint_retention_interval=4,
    ).train(handle_signals=False)
    assert backend.step == 12
    assert backend.retention_steps and all(s % 4 == 0 for s in backend.retention_steps)
    assert backend.violations == []
