"""The callback types a user hands to the trainer (the same shapes as ART's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import art
from art import Trajectory, TrajectoryGroup

ScenarioT = TypeVar("ScenarioT", bound=dict[str, Any])
ConfigT = TypeVar("ConfigT")

RolloutFn: TypeAlias = Callable[[art.TrainableModel, Any, Any], Awaitable[TrajectoryGroup]]
"""`async (model, scenario, config) -> TrajectoryGroup`: one group for one scenario."""

SingleRolloutFn: TypeAlias = Callable[[art.TrainableModel, Any, Any], Awaitable[Trajectory]]
"""`async (model, scenario, config) -> Trajectory`: one trajectory; see make_group_rollout_fn."""

EvalResult: TypeAlias = (
    list[Trajectory | TrajectoryGroup] | dict[str, list[Trajectory | TrajectoryGroup]]
)
EvalFn: TypeAlias = Callable[[art.TrainableModel, int, Any], Awaitable[EvalResult]]
"""`async (model, step, config) -> list | {split: list}`: a list is logged as split "val"."""

__all__ = ["ConfigT", "EvalFn", "EvalResult", "RolloutFn", "ScenarioT", "SingleRolloutFn"]
