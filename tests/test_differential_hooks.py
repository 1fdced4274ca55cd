"""Differential test: the Megatron-path backend hooks, ART 0.5.23's trainer beside art_trio.

A backend double with every optional hook ART 0.5.23's trainer calls (`prepare_pipeline_batch`,
`discard_pipeline_batch`, `adapter_retention_lease`, `exact_adapter_lease`,
`finalize_training_session`) records each call. ART's own `PipelineTrainer` runs under
asyncio, art_trio under trio and under asyncio, on one deterministic workload; the test
compares the order of the calls: each batch prepared (with ART's keyword arguments) before
it trains, each eval's retention lease taken after its step trained and held around the
eval's exact lease, the session finalized once, last. What runs concurrently (an eval beside
the next step) is compared per step, not as one interleaving.

ART 0.5.18 has none of these hooks: skipped there. ART's preparation path needs `msgspec`
(openpipe-art's "distributed" extra).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

import art_trio
from art_trio.plumbing.compat import ART_0520
from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs
from tests.doubles import RecordingBackend, served_trajectory, trajectory
from tests.test_parity_0518 import new_model

pytestmark = [
    pytest.mark.skipif(
        not ART_0520, reason="needs ART 0.5.20+ (Python 3.12+): 0.5.18 calls none of these hooks"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("msgspec") is None,
        reason="ART 0.5.23's batch-preparation path needs msgspec (openpipe-art[distributed])",
    ),
]

STEPS = 3
PREPARED_METRIC = "time/step_test_prepare_s"


@dataclass
class HookRecordingBackend(RecordingBackend):
    """The asyncio-only double, with every Megatron-path hook, recording each call."""

    events: list[tuple[Any, ...]] = field(default_factory=list)
    prepared: set[int] = field(default_factory=set)

    @asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> Any:
        asyncio.get_running_loop()
        yield

    @asynccontextmanager
    async def exact_adapter_lease(self, model: Any, step: int) -> Any:
        asyncio.get_running_loop()
        self.events.append(("exact_enter", step))
        try:
            yield
        finally:
            self.events.append(("exact_exit", step))

    @asynccontextmanager
    async def adapter_retention_lease(self, model: Any, step: int) -> Any:
        asyncio.get_running_loop()
        self.events.append(("retention_enter", step))
        try:
            yield
        finally:
            self.events.append(("retention_exit", step))

    async def prepare_pipeline_batch(
        self, model: Any, groups: list[art.TrajectoryGroup], **kwargs: Any
    ) -> dict[str, float]:
        asyncio.get_running_loop()
        self.events.append(("prepare", len(groups), tuple(sorted(kwargs.items()))))
        self.prepared.update(id(g) for g in groups)
        return {PREPARED_METRIC: 0.25}

    async def discard_pipeline_batch(self, groups: list[art.TrajectoryGroup]) -> None:
        self.events.append(("discard", len(groups)))

    async def finalize_training_session(self, model: Any) -> dict[str, float]:
        asyncio.get_running_loop()
        self.events.append(("finalize", self.step))
        return {"finalize/metric": 1.0}

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        self.events.append(("train", self.step + 1, all(id(g) in self.prepared for g in groups)))
        result = await super().train(model, groups, **kwargs)
        self.events.append(("trained", result.step))
        return result


async def rollout(model: Any, scenario: int, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])


async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
    return [served_trajectory(0.5, step)]


KWARGS: dict[str, Any] = dict(
    num_rollout_workers=2,
    min_batch_size=2,
    max_batch_size=2,
    eval_every_n_steps=1,
    max_steps=STEPS,
    log_interval_seconds=3600.0,
)


def run_art(root: Path, backend: HookRecordingBackend) -> art.TrainableModel:
    model = new_model(root, backend)
    trainer_class = art_pipeline_trainer()
    with pytest.MonkeyPatch.context() as patch:
        # The check imports art.local.backend (torch); the double is no LocalBackend.
        patch.setattr(trainer_class, "_validate_backend_support", lambda self: None)
        trainer = trainer_class(
            model, backend, rollout, list(range(2 * STEPS)), None, eval_fn,
            **art_trainer_kwargs(**KWARGS),
        )
    asyncio.run(trainer.train(handle_signals=False))
    return model


def run_art_trio(root: Path, backend: HookRecordingBackend, loop: str) -> art.TrainableModel:
    model = new_model(root, backend)
    trainer = art_trio.PipelineTrainer(
        model, backend, rollout, list(range(2 * STEPS)), None, eval_fn,
        admission="eager", **KWARGS,
    )
    train = functools.partial(trainer.train, handle_signals=False)
    if loop == "trio":
        trio.run(train)
    else:
        anyio.run(train, backend="asyncio")
    return model


@dataclass
class HookOrder:
    """The calls, as far as their order is fixed by the trainer (not by task scheduling)."""

    #: ("train", step, whether each of its groups was prepared first), in order.
    trains: list[tuple[Any, ...]]
    #: Keyword arguments of every prepare call, and how many groups each had.
    prepares: list[tuple[Any, ...]]
    #: Per eval step, the order of its lease events.
    per_eval_step: dict[int, list[str]]
    #: Eval steps whose retention lease was taken only after the step had trained.
    leased_after_training: set[int]
    finalize: list[tuple[Any, ...]]
    finalize_is_last: bool
    discards: int
    prepared_metric_in_train_rows: bool


def hook_order(backend: HookRecordingBackend, model: art.TrainableModel) -> HookOrder:
    events = backend.events
    per_step: dict[int, list[str]] = {}
    leased_after: set[int] = set()
    for index, event in enumerate(events):
        if event[0] in ("retention_enter", "retention_exit", "exact_enter", "exact_exit"):
            step = event[1]
            per_step.setdefault(step, []).append(event[0])
            if event[0] == "retention_enter" and (
                step == 0 or ("trained", step) in events[:index]
            ):
                leased_after.add(step)
    rows = [
        json.loads(line)
        for line in (Path(model._get_output_dir()) / "history.jsonl").read_text().splitlines()
    ]
    train_rows = [r for r in rows if "train/reward" in r]
    return HookOrder(
        trains=[e for e in events if e[0] == "train"],
        prepares=[e for e in events if e[0] == "prepare"],
        per_eval_step=per_step,
        leased_after_training=leased_after,
        finalize=[e for e in events if e[0] == "finalize"],
        finalize_is_last=bool(events) and events[-1][0] == "finalize",
        discards=sum(1 for e in events if e[0] == "discard"),
        prepared_metric_in_train_rows=bool(train_rows)
        and all(any(PREPARED_METRIC in k for k in r) for r in train_rows),
    )


@pytest.fixture(scope="module")
def art_order(tmp_path_factory: pytest.TempPathFactory) -> HookOrder:
    backend = HookRecordingBackend()
    model = run_art(tmp_path_factory.mktemp("art"), backend)
    return hook_order(backend, model)


def test_art_calls_the_hooks_as_this_test_assumes(art_order: HookOrder) -> None:
    assert art_order.trains == [("train", s, True) for s in range(1, STEPS + 1)]
    assert len(art_order.prepares) == STEPS
    assert set(art_order.per_eval_step) == set(range(STEPS + 1))
    assert art_order.finalize == [("finalize", STEPS)] and art_order.finalize_is_last
    assert art_order.prepared_metric_in_train_rows


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_art_trio_calls_the_hooks_in_arts_order(
    art_order: HookOrder, tmp_path: Path, loop: str
) -> None:
    backend = HookRecordingBackend()
    ours = hook_order(backend, run_art_trio(tmp_path, backend, loop))
    assert ours.trains == art_order.trains
    assert ours.prepares == art_order.prepares
    assert ours.per_eval_step == art_order.per_eval_step
    for step, order in ours.per_eval_step.items():
        assert order == ["retention_enter", "exact_enter", "exact_exit", "retention_exit"], step
    assert ours.leased_after_training == art_order.leased_after_training
    assert ours.finalize == art_order.finalize
    assert ours.finalize_is_last == art_order.finalize_is_last
    assert ours.discards == art_order.discards == 0
    assert ours.prepared_metric_in_train_rows == art_order.prepared_metric_in_train_rows


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_hooks_set_on_the_backend_instance_are_called_too(
    art_order: HookOrder, tmp_path: Path, loop: str
) -> None:
    """The same hooks as instance attributes of a backend whose class has none: art_trio calls
    them in the same order (ART 0.5.23 looks `adapter_retention_lease` up on the class)."""
    recorder = HookRecordingBackend()
    backend = RecordingBackend()
    for name in (
        "adapter_lease", "exact_adapter_lease", "adapter_retention_lease",
        "prepare_pipeline_batch", "discard_pipeline_batch", "finalize_training_session",
        "train",
    ):
        setattr(backend, name, getattr(recorder, name))
    recorder.step = backend.step
    model = run_art_trio(tmp_path, backend, loop)
    ours = hook_order(recorder, model)
    assert ours.trains == art_order.trains
    assert ours.per_eval_step == art_order.per_eval_step
    assert ours.finalize == art_order.finalize and ours.finalize_is_last
