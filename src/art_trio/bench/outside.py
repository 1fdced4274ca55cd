"""Recording a trainer that emits no events (ART's own `PipelineTrainer`) from outside it, in
the timeline log's format (`art_trio.timeline`), so the benchmark draws ART's runs beside
art_trio's.

    recorder = OutsideRecorder("art.jsonl", trainer="art", num_rollout_workers=8)
    trainer = ArtPipelineTrainer(model, backend, recorder.rollout(rollout_fn), ...)
    backend.train = recorder.train(backend.train)
    with recorder:
        await trainer.train()

Only what a trainer's callers can see is recorded: each rollout's start and end (the wrapped
rollout function), each `backend.train` call and the groups in it (the wrapped train), the
version each call publishes (its step, once it returns). The same log format as
`record_timeline`, so both draw alike. A fate is read off what happened: errored (the rollout
raised), cancelled (in flight at a cancellation: `dropped_at_stop`), zero variance (all its
rewards alike), trained (its scenario was in a train call); a completed group never trained is
stale if it completed before the last train call began, else the run's end left it behind.
Scenarios are told apart by `index_of(scenario)` and `group_index(group)` (default:
`metadata["scenario_id"]`, which trainers copy from a scenario onto its group).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from art_trio.timeline.log import LogWriter
from art_trio.timeline.recorder import how_it_ended


def _scenario_id(item: Any) -> int:
    metadata = item["metadata"] if isinstance(item, dict) else item.metadata
    return int(metadata["scenario_id"])


def _group_version(group: Any) -> int | None:
    versions = [
        v
        for t in group.trajectories
        if (v := getattr(t, "initial_policy_version", None)) is not None
    ]
    return min(versions) if versions else None


class OutsideRecorder:
    """A timeline log written by wrappers around a trainer's rollout function and train."""

    def __init__(
        self,
        path: str | Path,
        *,
        trainer: str = "art",
        clock: Callable[[], float] = time.monotonic,
        policy_version: int = 0,
        index_of: Callable[[Any], int] = _scenario_id,
        group_index: Callable[[Any], int] = _scenario_id,
        **sizes: Any,
    ) -> None:
        self.writer = LogWriter(path, trainer=trainer, clock="wrapped")
        self.clock = clock
        self.version = policy_version
        self._sizes = sizes
        self._index_of, self._group_index = index_of, group_index
        #: Completed with a trainable group and not trained yet: scenario -> completion time.
        self._completed: dict[int, float] = {}
        self._last_call_start: float | None = None

    def _write(self, name: str, **fields: Any) -> None:
        self.writer.write(self.clock(), name, **fields)

    def __enter__(self) -> OutsideRecorder:
        self._write("RunStarted", policy_version=self.version, **self._sizes)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        outcome, error = how_it_ended(exc)
        last = self._last_call_start
        for index, ended in sorted(self._completed.items()):
            left = last is None or ended >= last
            self._write("ScenarioSettled", scenario_index=index,
                        fate="dropped_at_stop" if left else "stale", rollout_s=0.0)  # fmt: skip
        self._write("RunEnded", outcome=outcome, error=error)
        self.writer.close()

    def rollout(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`fn` (a rollout function) recording each rollout's start, end and fate."""

        async def rollout(model: Any, scenario: Any, config: Any) -> Any:
            index = self._index_of(scenario)
            started = self.clock()
            self._write("RolloutStarted", scenario_index=index)
            fate = None
            try:
                group = await fn(model, scenario, config)
            except (asyncio.CancelledError, GeneratorExit):
                fate = "dropped_at_stop"
                raise
            except BaseException:
                fate = "errored"
                raise
            finally:
                spent = self.clock() - started
                self._write("RolloutEnded", scenario_index=index, spent_s=spent)
                if fate is not None:
                    self._write("ScenarioSettled", scenario_index=index, fate=fate, rollout_s=0.0)
            if len({t.reward for t in group.trajectories}) <= 1:
                self._write("ScenarioSettled", scenario_index=index, fate="zero_variance",
                            rollout_s=spent)  # fmt: skip
            else:
                self._completed[index] = self.clock()
                self._write("GroupQueued", scenario_index=index, queued=len(self._completed))
            return group

        return rollout

    def train(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`fn` (a backend's bound `train`) recording each call, its groups and its publish."""

        async def train(model: Any, trajectory_groups: Any, *args: Any, **kwargs: Any) -> Any:
            groups = list(trajectory_groups)
            step = self.version + 1
            indices = [self._group_index(g) for g in groups]
            self._last_call_start = began = self.clock()
            self._write("BatchTaken", step=step, batch_size=len(groups))
            self._write("TrainCallStarted", step=step, at=began)
            try:
                result = await fn(model, groups, *args, **kwargs)
            finally:
                self._write("TrainCallEnded", step=step, train_s=self.clock() - began)
            for index in indices:
                self._completed.pop(index, None)
                self._write("ScenarioSettled", scenario_index=index, fate="trained", rollout_s=0.0)
            versions = [_group_version(g) for g in groups]
            self._write(
                "StepTrained",
                step=step,
                batch_size=len(groups),
                scenario_indices=indices,
                staleness=[0 if v is None else step - 1 - v for v in versions],
            )
            self.version = int(getattr(result, "step", step))
            self._write("PolicyPublished", version=self.version)
            return result

        return train
