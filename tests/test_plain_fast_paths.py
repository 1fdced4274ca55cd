"""The rollout stage's quick passes over a returned group agree with the checks they skip.

`rollout_problem` reads a plain `art.Trajectory` in one quick look before the general checks,
and `stamp_policy_versions` writes ART's plain fields directly: neither may accept or write
anything the general way would not.
"""

from __future__ import annotations

import math
from typing import Any

import art
import pydantic
import pytest

from art_trio.policy.batching import _plain_field_writes, rollout_problem, stamp_policy_versions
from art_trio.testing.doubles import trajectory, trajectory_group


class _Sub(art.Trajectory):
    pass


class _Validated(art.Trajectory):
    model_config = pydantic.ConfigDict(validate_assignment=True)


def _with(field: str, value: Any) -> art.TrajectoryGroup:
    group = trajectory_group([0.0, 1.0])
    if field == "completion_tokens":
        group.trajectories[1].metrics["completion_tokens"] = value
    else:
        # As an assignment stores it on ART 0.5.18 (0.5.20+ validates assignments): as is.
        group.trajectories[1].__dict__[field] = value
    return group


CASES = [
    trajectory_group([0.0, 1.0]),
    trajectory_group([0.0, 1.0], usage=False),
    trajectory_group([]),
    _with("reward", math.nan),
    _with("reward", math.inf),
    _with("reward", 1),
    _with("reward", True),
    _with("initial_policy_version", 3),
    _with("initial_policy_version", True),
    _with("initial_policy_version", "3"),
    _with("final_policy_version", 2.0),
    _with("completion_tokens", 0),
    _with("completion_tokens", 2.5),
    _with("completion_tokens", math.inf),
    _with("completion_tokens", math.nan),
    _with("completion_tokens", -1),
    _with("completion_tokens", True),
    _with("completion_tokens", "3"),
    art.TrajectoryGroup([_Sub(messages_and_choices=[], reward=0.5)]),
]


def _general(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
    """The same trajectories as a subclass, which the quick look leaves to the general way."""
    copies = []
    for t in group.trajectories:
        copy = _Sub.model_construct(**t.__dict__)
        copy.__pydantic_private__ = dict(t.__pydantic_private__ or {})
        copies.append(copy)
    return art.TrajectoryGroup(copies)


def _two_problems() -> art.TrajectoryGroup:
    group = _with("reward", math.nan)
    group.trajectories[0].__dict__["initial_policy_version"] = "3"
    return group


@pytest.mark.parametrize("group", [*CASES, _two_problems()])
def test_the_quick_look_finds_what_the_general_way_finds(group: art.TrajectoryGroup) -> None:
    assert rollout_problem(group) == rollout_problem(_general(group))


def test_each_problem_is_named_rewards_first() -> None:
    assert rollout_problem(trajectory_group([0.0, 0.5, 1.0])) is None
    assert rollout_problem(trajectory_group([0.0, 1.0], usage=False)) is None
    assert "non-finite rewards (trajectory 1: nan)" in str(rollout_problem(_two_problems()))
    assert "trajectory 1 has initial_policy_version='3'" in str(
        rollout_problem(_with("initial_policy_version", "3"))
    )
    assert "trajectory 1 has completion_tokens=inf" in str(
        rollout_problem(_with("completion_tokens", math.inf))
    )
    assert rollout_problem(_with("completion_tokens", 0)) is None


def _stamped(t: art.Trajectory) -> tuple[Any, ...]:
    return (t.initial_policy_version, t.final_policy_version, t.model_fields_set)


@pytest.mark.parametrize("preset", [None, 1])
def test_stamp_writes_what_pydantic_assignment_does(preset: int | None) -> None:
    fast = trajectory(0.5, initial_policy_version=preset)
    slow = _Sub(**fast.model_dump(exclude_unset=True))  # the general way: setattr
    oldest = stamp_policy_versions(art.TrajectoryGroup([fast]), initial=4, final=6)
    assert oldest == stamp_policy_versions(art.TrajectoryGroup([slow]), initial=4, final=6)
    assert _stamped(fast) == _stamped(slow)
    assert fast.model_dump() == slow.model_dump()


def test_direct_writes_only_for_plain_fields() -> None:
    names = ("initial_policy_version", "final_policy_version")
    # ART 0.5.17-0.5.18: plain fields, written directly; 0.5.20+ validates every assignment
    # (`validate_assignment`), so the stage assigns as any other code does.
    validated = bool(art.Trajectory.model_config.get("validate_assignment"))
    assert _plain_field_writes(art.Trajectory, names) is not validated
    assert not _plain_field_writes(_Validated, names)
    assert not _plain_field_writes(art.Trajectory, ("no_such_field",))
