"""Differential test: ART 0.5.18's own trainer and art_trio on one deterministic workload.

Both trainers get the same scenarios, the same asyncio-only backend double (with ART 0.5.18's
optional `adapter_lease` and `prune_model_adapters`), instant rollouts, an eval every 2 steps
and retention keeping the 2 newest checkpoints plus the best eval. ART runs under
`asyncio.run`, art_trio under `trio.run` and under `anyio.run` (asyncio). The test compares
what a user can observe afterwards: steps trained, eval steps, checkpoints left on disk, the
metric keys logged per split in `history.jsonl` (art_trio's own `art_trio/...` metrics
aside), the backend calls, and `state.json`'s
`_pipeline_trainer` record.

art_trio runs with `admission="eager"`: the default staleness-aware admission and its
oldest-first batch selection change which groups go into which batch (never how many steps
or evals happen on this workload, see `test_staleness_aware_admission_trains_the_same_steps`).
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio
from art.pipeline_trainer import PipelineTrainer as ArtPipelineTrainer

import art_trio
from art_trio.plumbing.compat import ART_0520
from art_trio.resume.state import TALLY_FIELDS
from art_trio.testing import art_trainer_kwargs
from tests.doubles import HISTORY_KEYS, served_trajectory, trajectory
from tests.test_parity_0518 import LeasingBackend, eval_completed_steps, new_model

N_SCENARIOS = 30
ZERO_VARIANCE_EVERY = 5  # scenario i with i % 5 == 4 scores the same for every rollout
EVAL_EVERY = 2
BEST_EVAL_STEP = 4
SPLITS = ("train", "val", "test", "discarded", "checkpoint")

# The fields ART 0.5.18 persists under `_pipeline_trainer`; art_trio writes them too.
ART_STATE_FIELDS = {
    "scenario_offset",
    "total_scenarios_consumed",
    "training_step",
    "last_eval_step",
    "completed_eval_steps",
}
# The tallies ART 0.5.20+ persists there too; art_trio writes them on both lines.
ART_0520_STATE_FIELDS = set(TALLY_FIELDS)
# Some of art_trio's additions to that record (a deliberate difference, see the README).
ART_TRIO_STATE_FIELDS = {"pending_eval_steps", "resolved_scenarios", "pending_batch", "format"}


@dataclass
class DifferentialBackend(LeasingBackend):
    """LeasingBackend that starts a step only once every checkpoint's eval is recorded.

    Both trainers save a checkpoint exactly at the steps they evaluate. Waiting for those
    evals fixes the one race that decides which checkpoints retention keeps (is the latest
    eval done when the next step's retention runs?), so both trainers face the same order.
    """

    checkpointed: set[int] = field(default_factory=set)

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
        for _ in range(10_000):
            if self.checkpointed <= set(eval_completed_steps(model)):
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError(f"evals of {sorted(self.checkpointed)} never completed")
        result = await super().train(model, groups, **kwargs)
        if kwargs.get("save_checkpoint"):
            self.checkpointed.add(result.step)
        return result


def scenario_list() -> list[dict[str, Any]]:
    return [{"metadata": {"scenario_id": f"s{i}", "epoch": 0}, "i": i} for i in range(N_SCENARIOS)]


async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
    """Instant and deterministic: every 5th scenario has zero reward variance."""
    i = scenario["i"]
    if i % ZERO_VARIANCE_EVERY == ZERO_VARIANCE_EVERY - 1:
        rewards = [0.5, 0.5, 0.5]
    else:
        rewards = [0.0, 0.5, 1.0 + i / 100]
    return art.TrajectoryGroup(trajectory(r, metrics={"correct": float(r > 0.4)}) for r in rewards)


def eval_reward(step: int) -> float:
    """Rises with the step, except that step BEST_EVAL_STEP scores best of all."""
    return 0.99 if step == BEST_EVAL_STEP else step / 100


async def eval_fn(model: Any, step: int, config: Any) -> dict[str, list[Any]]:
    return {
        "val": [
            served_trajectory(eval_reward(step), step),
            served_trajectory(eval_reward(step) / 2, step),
        ],
        "test": [
            art.TrajectoryGroup([served_trajectory(0.1, step), served_trajectory(0.3, step)])
        ],
    }


TRAINER_KWARGS: dict[str, Any] = dict(
    num_rollout_workers=4,
    min_batch_size=2,
    max_batch_size=2,
    # A short queue: no group can age past max_steps_off_policy in either trainer, so what
    # trains is decided by the workload, not by how each event loop orders its tasks. With
    # the default (8) ART discards 0-2 groups as stale depending on that order.
    queue_maxsize=2,
    eval_every_n_steps=EVAL_EVERY,
    checkpoint_retention_strategy=art_trio.keep_recent_and_top(recent=2, top=1),
    log_interval_seconds=3600.0,
)


@dataclass
class Outcome:
    """What a user can observe after a run."""

    steps: list[int]
    train_kwargs: list[dict[str, Any]]
    eval_steps: list[int]
    checkpoints_kept: list[int]
    keys_by_split: dict[str, set[str]]
    pruned: list[list[int]]
    lease_steps: set[int]
    leases_left: dict[int, int]
    state: dict[str, Any]
    history: list[dict[str, Any]]


def row_split(row: dict[str, Any]) -> str:
    """The split a history row was logged for, from its keys' first components."""
    found = sorted({key.split("/", 1)[0] for key in row} & set(SPLITS))
    return "+".join(found) if found else "?"


def is_art_trio_metric(key: str) -> bool:
    """art_trio's own measures (`art_trio/...`, filed by `model.log` as `train/art_trio/...`)."""
    return "art_trio" in key.split("/")


def outcome(model: art.TrainableModel, backend: LeasingBackend) -> Outcome:
    out = Path(model._get_output_dir())
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    keys: dict[str, set[str]] = {}
    for row in history:
        keys.setdefault(row_split(row), set()).update(
            key for key in row if not is_art_trio_metric(key)
        )
    evals = sorted(
        row["step"] for row in history if "checkpoint/eval_completed" in row
    )
    checkpoints = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.is_dir())
    state = json.loads((out / "state.json").read_text())["_pipeline_trainer"]
    return Outcome(
        steps=[call.step for call in backend.calls],
        train_kwargs=[call.kwargs for call in backend.calls],
        eval_steps=evals,
        checkpoints_kept=checkpoints,
        keys_by_split=keys,
        pruned=backend.prune_calls,
        lease_steps=set(backend.leases_taken),
        leases_left=dict(backend.active_leases),
        state=state,
        history=history,
    )


def run_art(root: Path, backend: DifferentialBackend | None = None, **overrides: Any) -> Outcome:
    backend = backend or DifferentialBackend()
    model = new_model(root, backend)
    with pytest.MonkeyPatch.context() as patch:
        # The check imports art.local.backend, which needs torch; the double is no LocalBackend.
        patch.setattr(ArtPipelineTrainer, "_validate_backend_support", lambda self: None)
        trainer = ArtPipelineTrainer(
            model, backend, rollout, scenario_list(), None, eval_fn,
            **art_trainer_kwargs(**TRAINER_KWARGS, **overrides),
        )
    asyncio.run(trainer.train(handle_signals=False))
    return outcome(model, backend)


@pytest.fixture(scope="module")
def art_outcome(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return run_art(tmp_path_factory.mktemp("art"))


def run_art_trio(
    root: Path, loop: str, backend: DifferentialBackend | None = None, **overrides: Any
) -> Outcome:
    backend = backend or DifferentialBackend()
    model = new_model(root, backend)
    kwargs = {**TRAINER_KWARGS, "admission": "eager", **overrides}
    trainer = art_trio.PipelineTrainer(
        model, backend, rollout, scenario_list(), None, eval_fn, **kwargs
    )
    train = functools.partial(trainer.train, handle_signals=False)
    if loop == "trio":
        trio.run(train)
    else:
        anyio.run(train, backend="asyncio")
    return outcome(model, backend)


N_USABLE = N_SCENARIOS - N_SCENARIOS // ZERO_VARIANCE_EVERY
N_STEPS = N_USABLE // 2


def stale_groups(result: Outcome) -> float:
    return [row for row in result.history if "train/reward" in row][-1][
        HISTORY_KEYS["stale_groups"]
    ]


def test_art_itself_behaves_as_this_test_assumes(art_outcome: Outcome) -> None:
    """Guards the workload: if ART's own numbers move, the comparison below means nothing."""
    assert art_outcome.steps == list(range(1, N_STEPS + 1))
    assert stale_groups(art_outcome) == 0
    assert art_outcome.eval_steps == list(range(0, N_STEPS + 1, EVAL_EVERY))
    # The 2 newest eval checkpoints before the last step, the best eval, and the last step.
    assert art_outcome.checkpoints_kept == [BEST_EVAL_STEP, N_STEPS - 4, N_STEPS - 2, N_STEPS]
    assert "discarded" in art_outcome.keys_by_split
    assert set(art_outcome.eval_steps) <= art_outcome.lease_steps
    assert not art_outcome.leases_left


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_same_steps_evals_checkpoints_and_metric_keys_as_art(
    art_outcome: Outcome, tmp_path: Path, loop: str
) -> None:
    ours = run_art_trio(tmp_path / "trio", loop)
    assert ours.steps == art_outcome.steps
    assert ours.train_kwargs == art_outcome.train_kwargs
    assert ours.eval_steps == art_outcome.eval_steps
    assert ours.checkpoints_kept == art_outcome.checkpoints_kept
    assert ours.keys_by_split.keys() == art_outcome.keys_by_split.keys()
    for split, keys in art_outcome.keys_by_split.items():
        assert ours.keys_by_split[split] == keys, split
    assert ours.pruned == art_outcome.pruned
    # Which versions rollouts start at depends on task order; evals lease their own step.
    assert set(ours.eval_steps) <= ours.lease_steps <= set(range(N_STEPS + 1))
    assert not ours.leases_left
    # ART's fields, with ART's values; art_trio adds its own (resume ledger, pending evals).
    assert ART_STATE_FIELDS <= set(art_outcome.state)
    assert set(art_outcome.state) <= ART_STATE_FIELDS | ART_0520_STATE_FIELDS
    for name in art_outcome.state:
        assert ours.state[name] == art_outcome.state[name], name
    assert ART_TRIO_STATE_FIELDS <= set(ours.state)


@pytest.mark.skipif(
    not ART_0520, reason="needs ART 0.5.20+ (Python 3.12+): 0.5.18 has none of these kwargs"
)
def test_the_0520_training_kwargs_reach_backend_train_as_art_passes_them(tmp_path: Path) -> None:
    """kl_penalty_step_lag, grad_accumulation_sequences and optimizer_save_interval, set."""
    settings: dict[str, Any] = dict(
        kl_penalty_coef=0.05,
        kl_penalty_step_lag=3,
        grad_accumulation_sequences=4,
        optimizer_save_interval=2,
        learning_rate=3e-5,
    )
    theirs = run_art(tmp_path / "art", **settings)
    ours = run_art_trio(tmp_path / "trio", "trio", **settings)
    assert ours.steps == theirs.steps
    assert ours.train_kwargs == theirs.train_kwargs
    lags = [kwargs["kl_penalty_reference_step"] for kwargs in ours.train_kwargs]
    assert lags == [max(0, step - 1 - 3) for step in ours.steps]  # the lag is really applied


def test_staleness_aware_admission_trains_the_same_steps(
    art_outcome: Outcome, tmp_path: Path
) -> None:
    """The default admission changes batch composition, not the observable totals here."""
    ours = run_art_trio(tmp_path / "trio", "trio", admission="staleness_aware")
    assert ours.steps == art_outcome.steps
    assert ours.eval_steps == art_outcome.eval_steps
    assert ours.checkpoints_kept == art_outcome.checkpoints_kept


def test_resumed_start_step_is_evaluated_by_art_but_not_by_art_trio(tmp_path: Path) -> None:
    """A deliberate difference, measured: stop after 3 steps, then resume.

    ART 0.5.18 evaluates the step it resumes at (3) and restarts its every-2 schedule there
    (5, 7, ...). art_trio evaluates a start step only on a fresh run or at step 0; a resumed
    run keeps the schedule it had (4, 6, ...).
    """
    art_backend, ours_backend = DifferentialBackend(), DifferentialBackend()
    run_art(tmp_path / "art", art_backend, max_steps=3)
    theirs = run_art(tmp_path / "art", art_backend)
    run_art_trio(tmp_path / "trio", "trio", ours_backend, max_steps=3)
    ours = run_art_trio(tmp_path / "trio", "trio", ours_backend)
    theirs_resumed = [s for s in theirs.eval_steps if s >= 3]
    ours_resumed = [s for s in ours.eval_steps if s >= 3]
    assert theirs.eval_steps[:2] == ours.eval_steps[:2] == [0, 2]
    assert theirs_resumed[0] == 3
    assert all((s - 3) % EVAL_EVERY == 0 for s in theirs_resumed)
    assert ours_resumed and all(s % EVAL_EVERY == 0 for s in ours_resumed)
    assert theirs.history[0]["step"] == 0  # both histories continue in the same file


def trained_scenarios(backend: DifferentialBackend) -> list[str]:
    return [sid for call in backend.calls for sid in call.scenario_ids]


def test_art_trio_resumes_a_run_that_arts_trainer_started(tmp_path: Path) -> None:
    """Switching trainers mid-run: art_trio reads ART's `_pipeline_trainer` record."""
    backend = DifferentialBackend()
    run_art(tmp_path, backend, max_steps=3)
    art_state = json.loads((tmp_path / ".art/p/models/m/state.json").read_text())
    skipped = art_state["_pipeline_trainer"]["scenario_offset"]
    ours = run_art_trio(tmp_path, "trio", backend)
    assert ours.steps == list(range(1, len(ours.steps) + 1)) and len(ours.steps) > 3
    trained = trained_scenarios(backend)
    assert len(trained) == len(set(trained))  # nothing trained twice
    # ART's offset counts what it took, trained or not: art_trio starts after it (the
    # scenarios ART held in its queue are lost, as they would be if ART resumed itself).
    assert all(int(sid[1:]) >= skipped for sid in trained[6:])
    assert ours.eval_steps == list(range(0, ours.steps[-1] + 1, EVAL_EVERY))


def test_arts_trainer_resumes_a_run_that_art_trio_started(tmp_path: Path) -> None:
    """The other way: ART reads the fields it knows and ignores art_trio's additions."""
    backend = DifferentialBackend()
    run_art_trio(tmp_path, "trio", backend, max_steps=3)
    record = json.loads((tmp_path / ".art/p/models/m/state.json").read_text())
    ours_state = record["_pipeline_trainer"]
    theirs = run_art(tmp_path, backend)
    assert theirs.steps == list(range(1, len(theirs.steps) + 1)) and len(theirs.steps) > 3
    trained = trained_scenarios(backend)
    # ART resumes at art_trio's watermark: scenarios art_trio resolved above it (trained or
    # discarded out of order) are the only ones ART can see again.
    again = {sid for sid in trained if trained.count(sid) > 1}
    assert again <= {f"s{i}" for i in ours_state["resolved_scenarios"]}
    everything = {f"s{i}" for i in range(N_SCENARIOS) if i % ZERO_VARIANCE_EVERY != 4}
    assert everything - set(trained) == set()
    # ART evaluates the step it resumes at (3) and restarts its schedule there.
    assert theirs.eval_steps[:3] == [0, 2, 3]


def test_art_trio_then_art_then_art_trio_trains_nothing_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """art_trio's own snapshot is older than ART's record after ART trained in between: the
    third run resumes from ART's record, not from the snapshot (which would train again what
    ART trained)."""
    backend = DifferentialBackend()
    run_art_trio(tmp_path, "trio", backend, max_steps=2)
    theirs = run_art(tmp_path, backend, max_steps=4)
    arts = trained_scenarios(backend)[4:]
    assert arts and theirs.steps[-1] > 2
    with caplog.at_level("WARNING", logger="art_trio"):
        ours = run_art_trio(tmp_path, "trio", backend)
    assert ours.steps[-1] > theirs.steps[-1]
    trained = trained_scenarios(backend)
    assert sorted(sid for sid in set(trained) if trained.count(sid) > 1) == []
    assert "another trainer (ART's) ran on this directory since" in caplog.text
