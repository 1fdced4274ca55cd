"""Building a group rollout from a single-trajectory rollout."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import art
from art import Trajectory, TrajectoryGroup

from ..messages.errors import CallbackNotAwaitable
from ..messages.types import RolloutFn, SingleRolloutFn
from .bridge.calls import await_callback, is_native, trio_native
from .compat import FATAL_ROLLOUT_ERRORS


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn, n: int = 4) -> RolloutFn:
    """A rollout_fn that runs `single_rollout_fn` `n` times concurrently for each scenario
    (`n`, the group's size: a whole number >= 1, several for a group to have a reward spread).

    Rollouts that raise become the group's `exceptions`; the others its trajectories. As in
    ART 0.5.20+, a rollout raising `LocalServingUnavailableError` (the local inference server
    is gone) makes the group rollout raise it, once all `n` have ended. The result is asyncio
    code (it uses `asyncio.gather`, as ART's does) unless
    `single_rollout_fn` is marked `trio_native`; then it runs the `n` rollouts in an anyio
    task group and is itself native.
    """
    if not callable(single_rollout_fn):
        raise TypeError(
            "single_rollout_fn must be an async function of (model, scenario, config) "
            f"returning an art.Trajectory, got {type(single_rollout_fn).__name__}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"n must be a whole number >= 1, the trajectories of each group, got {n!r} (a "
            "group's advantages compare its trajectories' rewards: use 4 to 16)"
        )
    if is_native(single_rollout_fn):

        async def native_group_rollout(
            model: art.TrainableModel, scenario: Any, config: Any
        ) -> TrajectoryGroup:
            results: list[Trajectory | BaseException] = []

            async def one() -> None:
                try:
                    results.append(await await_callback(single_rollout_fn, model, scenario, config))
                except CallbackNotAwaitable:
                    raise
                except Exception as exc:
                    results.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)
            _raise_fatal(results)
            return TrajectoryGroup(results)

        return trio_native(native_group_rollout)

    async def group_rollout(
        model: art.TrainableModel, scenario: Any, config: Any
    ) -> TrajectoryGroup:
        results = await asyncio.gather(
            *(await_callback(single_rollout_fn, model, scenario, config) for _ in range(n)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, CallbackNotAwaitable):
                raise result  # a programming error, not one failed trajectory
        _raise_fatal(results)
        return TrajectoryGroup(results)

    return group_rollout


def _raise_fatal(results: list[Any]) -> None:
    """Raise the first rollout error that must end the run (see compat.FATAL_ROLLOUT_ERRORS)."""
    for result in results:
        if isinstance(result, FATAL_ROLLOUT_ERRORS):
            raise result
