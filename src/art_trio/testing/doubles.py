"""Doubles of what a pipeline trainer talks to: ART's backend, an eval function, trajectories.

One implementation of ART's ``Backend`` protocol serves the unit tests (``tests/doubles.py``),
the property harness (``property_tests/harness.py``), the simulator and the benchmark
(``art_trio.sim.doubles``); each adds only what it records, through :meth:`BackendDouble.record`
(or a subclass hook), never a second copy of the protocol.

Two flavors:

- ``"anyio"`` (default): sleeps and reads time through anyio, so the same object works under
  ART's asyncio trainer, under art_trio on trio or asyncio, and under trio's ``MockClock``.
- ``"asyncio"``: every method first asserts it runs in an asyncio event loop and uses asyncio
  primitives only, as a real ART backend does; under trio a test then passes only if art_trio
  really reaches the backend through the trio-asyncio bridge.

This module imports nothing from art_trio outside this subpackage: the benchmark's ART child
process imports it without running ``art_trio/__init__.py`` (see ``art_trio.bench.child``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

# ART pulls in litellm, which downloads a price map at import time unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
from art.types import TrainResult  # noqa: E402

__all__ = [
    "BackendDouble",
    "EvalCall",
    "EvalDouble",
    "Flavor",
    "TrainBatch",
    "clock_for",
    "group_initial_version",
    "trajectory",
    "trajectory_group",
]

Flavor = Literal["anyio", "asyncio"]

#: One user/assistant exchange: trainers pass messages through untouched.
MESSAGES: tuple[Any, ...] = (
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "a"},
)
#: What a serving response's usage would give; ART 0.5.20+'s trainer refuses groups without it.
USAGE: dict[str, float | int | bool] = {"completion_tokens": 1}


def trajectory(reward: float, *, usage: bool = True, **kwargs: Any) -> art.Trajectory:
    """A one-exchange trajectory with ``reward`` (and the serving usage unless ``usage=False``).

    ``kwargs`` go to ``art.Trajectory``; ``metrics`` given there are merged over the usage.
    """
    if usage:
        kwargs["metrics"] = {**USAGE, **kwargs.get("metrics", {})}
    return art.Trajectory(messages_and_choices=list(MESSAGES), reward=reward, **kwargs)


def trajectory_group(
    rewards: Iterable[float], *, usage: bool = True, **metadata: Any
) -> art.TrajectoryGroup:
    """A group of one trajectory per reward, with ``metadata`` on the group."""
    return art.TrajectoryGroup(
        [trajectory(r, usage=usage) for r in rewards], metadata=dict(metadata)
    )


def group_initial_version(group: art.TrajectoryGroup) -> int | None:
    """The oldest ``initial_policy_version`` of the group's trajectories (as ART reads it)."""
    versions = [
        t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None
    ]
    return min(versions) if versions else None


def _asyncio_now() -> float:
    return asyncio.get_running_loop().time()


def clock_for(flavor: Flavor) -> tuple[Callable[[float], Awaitable[None]], Callable[[], float]]:
    """``(sleep, now)`` of a flavor: anyio's, or asyncio's (the running loop's clock)."""
    if flavor == "asyncio":
        return asyncio.sleep, _asyncio_now
    if flavor == "anyio":
        return anyio.sleep, anyio.current_time
    raise ValueError(f"flavor must be 'anyio' or 'asyncio', got {flavor!r}")


def _durations(value: float | Callable[[int], float] | Sequence[float]) -> Callable[[int], float]:
    """Duration of call ``i``: a constant, a function of ``i``, or a sequence cycled over."""
    if callable(value):
        return value
    if isinstance(value, (int, float)):
        constant = float(value)
        return lambda _index: constant
    cycle = tuple(float(v) for v in value) or (0.0,)
    return lambda index: cycle[index % len(cycle)]


@dataclass(frozen=True)
class TrainBatch:
    """One ``backend.train`` call, as the backend double saw it."""

    #: The policy version the step produced (``TrainResult.step``).
    step: int
    #: The policy version the step trained from.
    base_version: int
    #: When the train call started its work and when it finished, in the flavor's clock.
    start: float
    end: float
    groups: list[art.TrajectoryGroup]
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: The model it trained.
    model: Any = None


class BackendDouble:
    """ART's ``Backend`` protocol as pipeline trainers use it, with a configurable train time.

    Implements ``register``, ``_get_step``, ``train``, ``_model_inference_name``,
    ``_prepare_backend_for_training``, ``_delete_checkpoint_files`` and ``close``; it has
    neither ``adapter_lease`` nor ``prune_model_adapters`` (tests add them in subclasses).

    ``train`` sleeps ``train_time`` (seconds, or a function of the call's index, or a sequence
    cycled over), optionally raises at ``fail_on_step``, bumps the step and hands a
    :class:`TrainBatch` to :meth:`record` (``on_train`` by default). Subclasses may override
    :meth:`before_train` (to hold a step), :meth:`record`, :meth:`train_metrics` and
    :meth:`delete_checkpoints`. With ``work_in_task`` (asyncio flavor only) the sleep runs in
    an asyncio task of its own, as real backends do their work.
    """

    def __init__(
        self,
        *,
        train_time: float | Callable[[int], float] | Sequence[float] = 0.0,
        flavor: Flavor = "anyio",
        initial_step: int = 0,
        fail_on_step: int | None = None,
        on_train: Callable[[TrainBatch], None] | None = None,
        inference_endpoint: tuple[str, str] = ("http://127.0.0.1:9/v1", "test-key"),
        work_in_task: bool = False,
    ) -> None:
        if work_in_task and flavor != "asyncio":
            raise ValueError("work_in_task needs the asyncio flavor")
        self.flavor: Flavor = flavor
        self._sleep, self._now = clock_for(flavor)
        self.train_time = _durations(train_time)
        self.step = initial_step
        self.fail_on_step = fail_on_step
        self.on_train = on_train
        self.inference_endpoint = inference_endpoint
        self.work_in_task = work_in_task
        #: train() calls entered, calls that did their work, calls running now and at most.
        self.train_started = 0
        self.train_calls = 0
        self.training = 0
        self.max_concurrent_training = 0
        self.closed = False

    # -- hooks ---------------------------------------------------------------------------

    def train_seconds_for(self, index: int) -> float:
        """How long train call number ``index`` (0-based) works."""
        return self.train_time(index)

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        """Awaited at the start of every train call, before its work (default: nothing)."""

    def record(self, batch: TrainBatch) -> None:
        """Called with every finished train call (default: ``on_train``, if set)."""
        if self.on_train is not None:
            self.on_train(batch)

    def train_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """The metrics the ``TrainResult`` carries (default: none)."""
        return {}

    def delete_checkpoints(self, model: Any, steps_to_keep: list[int]) -> None:
        """What ``_delete_checkpoint_files`` does (default: nothing; no files are written)."""

    # -- ART's Backend protocol ----------------------------------------------------------

    def _check_loop(self) -> None:
        if self.flavor == "asyncio":
            # Raises RuntimeError outside an asyncio loop (e.g. called straight from trio).
            asyncio.get_running_loop()

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def close(self) -> None:
        self._check_loop()
        self.closed = True

    async def register(self, model: Any) -> None:
        """Nothing to set up; the model just needs a backend object."""
        self._check_loop()

    async def _get_step(self, model: Any) -> int:
        self._check_loop()
        return self.step

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        self._check_loop()
        self.delete_checkpoints(model, steps_to_keep)

    async def _prepare_backend_for_training(
        self, model: Any, config: Any = None
    ) -> tuple[str, str]:
        # Never dialled: the rollout doubles do not talk to an inference server.
        self._check_loop()
        return self.inference_endpoint

    async def _work(self, seconds: float) -> None:
        if not self.work_in_task:
            await self._sleep(seconds)
            return
        done = asyncio.Event()

        async def work() -> None:
            await asyncio.sleep(seconds)
            done.set()

        task = asyncio.get_running_loop().create_task(work())
        await done.wait()
        await task

    async def train(
        self, model: Any, trajectory_groups: Iterable[art.TrajectoryGroup], **kwargs: Any
    ) -> TrainResult:
        """Work the call's train time, then produce the next policy version."""
        self._check_loop()
        groups = list(trajectory_groups)
        self.train_started += 1
        await self.before_train(groups)
        start = self._now()
        base_version = self.step
        duration = self.train_seconds_for(self.train_calls)
        self.train_calls += 1
        self.training += 1
        self.max_concurrent_training = max(self.max_concurrent_training, self.training)
        try:
            await self._work(duration)
        finally:
            self.training -= 1
        if self.fail_on_step is not None and base_version + 1 == self.fail_on_step:
            raise RuntimeError(f"backend exploded at step {base_version + 1}")
        self.step += 1
        batch = TrainBatch(
            step=self.step,
            base_version=base_version,
            start=start,
            end=self._now(),
            groups=groups,
            kwargs=dict(kwargs),
            model=model,
        )
        self.record(batch)
        return TrainResult(step=self.step, metrics=self.train_metrics(batch))


@dataclass
class EvalCall:
    """One call of an :class:`EvalDouble`."""

    step: int
    started_at: float
    ended_at: float | None = None
    #: It worked its whole duration (False: cancelled or interrupted).
    completed: bool = False
    #: What ``on_start`` returned for it.
    token: Any = None


class EvalDouble:
    """An ``eval_fn(model, step, config)`` that works a duration per call and records it.

    ``durations`` as for :class:`BackendDouble`'s train time (by call index). ``on_start``
    is called with the new :class:`EvalCall` (its return value becomes the call's ``token``),
    ``on_end`` with it once the eval ends, also when it is cancelled. Counts evals running
    at once (``active``, ``max_active``). Returns one trajectory.
    """

    def __init__(
        self,
        durations: float | Callable[[int], float] | Sequence[float] = 0.0,
        *,
        flavor: Flavor = "anyio",
        usage: bool = True,
        on_start: Callable[[EvalCall], Any] | None = None,
        on_end: Callable[[EvalCall], None] | None = None,
    ) -> None:
        self._durations = _durations(durations)
        self._sleep, self._now = clock_for(flavor)
        self._usage = usage
        self._on_start = on_start
        self._on_end = on_end
        self.calls = 0
        self.active = 0
        self.max_active = 0

    async def __call__(
        self, model: Any, step: int, config: Any
    ) -> list[art.Trajectory | art.TrajectoryGroup]:
        duration = self._durations(self.calls)
        self.calls += 1
        call = EvalCall(step=step, started_at=self._now())
        if self._on_start is not None:
            call.token = self._on_start(call)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self._sleep(duration)
            call.completed = True
        finally:
            self.active -= 1
            call.ended_at = self._now()
            if self._on_end is not None:
                self._on_end(call)
        return [trajectory(1.0, usage=self._usage)]
