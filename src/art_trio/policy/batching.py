"""Pure decisions over groups: stale, zero variance, broken, and what a batch reports.

No awaits and no state here, so property tests can call these directly and the stages stay
about flow. Every rule mirrors the reference's; where art_trio adds one (non-finite rewards)
the docstring says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from art import Trajectory, TrajectoryGroup
from pydantic import BaseModel

from ..messages.errors import FuturePolicyError
from .freshness import PLAIN_COUNTS, token_count_problem

#: Rewards closer than this count as equal (the reference's tolerance).
ZERO_VARIANCE_TOLERANCE = 1e-12

#: Scenario metadata keys a rollout failure line names, when the scenario has them.
FAILURE_CONTEXT_KEYS = ("scenario_id", "epoch", "scenario_index")


#: The window that stands for "no bound on staleness" (both bounds off): no run trains this
#: many steps, and the gate's arithmetic stays in integers.
UNBOUNDED_STEPS = 1_000_000


@dataclass(frozen=True, slots=True)
class Freshness:
    """When a group is too old to train, under ART 0.5.20's two bounds (either may be off).

    A group trained from step `s` is stale when its oldest trajectory started more than
    `max_steps_off_policy` versions before `s`, or when the token-weighted mean policy age of
    its tokens exceeds `limit_mean_steps_off_policy`. A group's tokens mostly share its start
    version, so for admission both bounds act as one integer window (`window`).
    """

    max_steps_off_policy: int | None
    limit_mean_steps_off_policy: float | None = None

    @property
    def window(self) -> int:
        """Versions behind the step it trains from that a single-version group may be."""
        windows = [UNBOUNDED_STEPS]
        if self.max_steps_off_policy is not None:
            windows.append(self.max_steps_off_policy)
        if self.limit_mean_steps_off_policy is not None:
            windows.append(math.floor(self.limit_mean_steps_off_policy))
        return min(windows)

    def cancel_window(self, in_flight_updates: bool) -> int:
        """Versions behind the step being trained at which a rollout still running is
        cancelled, its tokens thrown away.

        Without in-flight updates every token of a rollout comes from its start version, so
        that is `window`. With them, tokens decoded after an update come from the newer
        policy, and the mean bound judges the mix: a rollout that started at v and decodes at
        an even pace until it ends at version e has a mean version near (v + e) / 2, so a
        batch from step s >= e may still take it while s - v <= 2 x the mean limit. Beyond
        that it is cancelled. This only decides what is thrown away early: the finished
        group's exact spans are what both bounds are checked on. The hard bound is on the
        start version (ART 0.5.23's rule), which no later token changes.
        """
        limit = self.limit_mean_steps_off_policy
        if not in_flight_updates or limit is None:
            return self.window
        windows = [UNBOUNDED_STEPS, math.floor(2 * limit)]
        if self.max_steps_off_policy is not None:
            windows.append(self.max_steps_off_policy)
        return min(windows)

    @property
    def queue_window(self) -> int:
        """The steps ART sizes its queue and adapter retention by: the hard bound, else the
        mean bound rounded up, else 1 (queue) / 0 (retention, see `retention_window`)."""
        if self.max_steps_off_policy is not None:
            return self.max_steps_off_policy
        if self.limit_mean_steps_off_policy is not None:
            return math.ceil(self.limit_mean_steps_off_policy)
        return 1

    @property
    def retention_window(self) -> int:
        """Steps behind the current one whose adapters ART keeps servable."""
        if self.max_steps_off_policy is None and self.limit_mean_steps_off_policy is None:
            return 0
        return self.queue_window

    def is_stale(self, version: int | None, mean_version: float | None, step: int) -> bool:
        """Too old for the batch trained from `step`; unversioned groups never are."""
        if (
            self.max_steps_off_policy is not None
            and version is not None
            and version < step - self.max_steps_off_policy
        ):
            return True
        limit = self.limit_mean_steps_off_policy
        if limit is None:
            return False
        if mean_version is None or not math.isfinite(mean_version):
            # No per-token weights known (or none that add up to a number): the group's start
            # version, its oldest, stands for all its tokens. Never weaker than the mean.
            mean_version = version
        return mean_version is not None and step - mean_version > limit


def newest_version(versions: Iterable[int | None]) -> int | None:
    """The newest of the versions given (None for none)."""
    known = [v for v in versions if v is not None]
    return max(known) if known else None


def future_policy_error(
    newest: int | None, trainer_version: int, *, scenario_index: int, context: str = ""
) -> FuturePolicyError | None:
    """The error for a group whose newest token version is ahead of the trainer's policy."""
    if newest is None or newest <= trainer_version:
        return None
    return FuturePolicyError(
        f"Trajectory tokens came from a future policy: policy={newest}, "
        f"trainer={trainer_version} (scenario index {scenario_index}{context}). A trajectory's "
        "initial_policy_version (or its per-token policy versions) must not be newer than the "
        "trainer's policy: is it replayed from another run, or was the version counter reset? "
        "Its age is unknown, so it is trained under no bound; the run stops here and the "
        "scenario stays unresolved (a resumed run rolls it again)."
    )


def is_zero_variance(group: TrajectoryGroup) -> bool:
    """No learning signal: one trajectory or fewer, or every reward the same."""
    rewards = [t.reward for t in group.trajectories]
    if len(rewards) <= 1:
        return True
    first = rewards[0]
    return all(abs(r - first) <= ZERO_VARIANCE_TOLERANCE for r in rewards[1:])


def all_failed_error(group: TrajectoryGroup) -> RuntimeError | None:
    """The reference's error for a group whose every rollout raised, else None."""
    if group.trajectories or not group.exceptions:
        return None
    first = group.exceptions[0]
    return RuntimeError(
        f"All {len(group.exceptions)} rollouts in group failed. "
        f"First exception ({first.type}): {first.message}"
    )


def rollout_problem(group: TrajectoryGroup) -> str | None:
    """Why a group a rollout returned cannot be trained, else None; one pass over its
    trajectories, the problems named in this order:

    - a NaN or infinite reward (art_trio's rule: one would turn the whole batch's normalized
      advantages into NaN on the backend);
    - a policy version that is not an int (pydantic does not check assignments, and the
      bounds could not compare it);
    - a token count that cannot weigh the group's policy age (`token_count_problem`).
    """
    bad_rewards: list[tuple[int, float]] = []
    versions: str | None = None
    tokens: str | None = None
    for i, t in enumerate(group.trajectories):
        if _plainly_fine(t):
            continue
        if not math.isfinite(t.reward):
            bad_rewards.append((i, t.reward))
        versions = versions or _version_problem(i, t)
        tokens = tokens or token_count_problem(i, t)
    if bad_rewards:
        shown = ", ".join(f"trajectory {i}: {r!r}" for i, r in bad_rewards[:3])
        more = f" and {len(bad_rewards) - 3} more" if len(bad_rewards) > 3 else ""
        return (
            f"group has non-finite rewards ({shown}{more}); "
            "return a finite float reward from every trajectory"
        )
    return versions or tokens


def _plainly_fine(t: Trajectory) -> bool:
    """What a rollout usually returns, read in one quick look: a plain `art.Trajectory` with a
    finite float reward, int or None versions, no per-token counts, and a plain finite
    non-negative token count or none. None of `rollout_problem`'s checks objects to it."""
    if type(t) is not Trajectory or (t.__pydantic_private__ or {}).get("_policy_token_counts"):
        return False
    fields = t.__dict__
    reward, metrics = fields["reward"], fields["metrics"]
    initial, final = fields["initial_policy_version"], fields["final_policy_version"]
    count = metrics.get("completion_tokens") if type(metrics) is dict else math.nan
    return (
        type(reward) is float and -math.inf < reward < math.inf
        and (initial is None or type(initial) is int)
        and (final is None or type(final) is int)
        and (count is None or (type(count) in PLAIN_COUNTS and 0 <= count < math.inf))
    )


def _version_problem(index: int, trajectory: Trajectory) -> str | None:
    for name in ("initial_policy_version", "final_policy_version"):
        value = getattr(trajectory, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return (
                f"trajectory {index} has {name}={value!r}: a policy version is an int (a "
                "step number) or None for the trainer to fill in"
            )
    return None


def _plain_field_writes(model: Any, names: tuple[str, ...]) -> bool:
    """Whether assigning `names` on a `model` instance only stores the value and marks the
    field set (no validation, no frozen field, no custom `__setattr__`), as pydantic does for
    a plain field: then the stage may do just that."""
    config = model.model_config
    return (
        model.__setattr__ is BaseModel.__setattr__
        and not config.get("validate_assignment")
        and not config.get("frozen")
        and all(
            name in model.model_fields
            and not model.model_fields[name].frozen
            and name not in model.__class_vars__
            and name not in vars(model)  # (no property or descriptor of that name)
            for name in names
        )
    )


#: `art.Trajectory`'s policy versions are plain fields (`stamp_policy_versions`).
_PLAIN_FIELD_WRITES = _plain_field_writes(
    Trajectory, ("initial_policy_version", "final_policy_version")
)


def stamp_policy_versions(group: TrajectoryGroup, *, initial: int, final: int) -> int | None:
    """Record which policy versions a rollout spanned, keeping versions it set itself.

    Returns the group's initial version afterwards (the oldest any trajectory started from),
    found in the same pass: None only for a group without trajectories.
    """
    oldest: int | None = None
    for trajectory in group.trajectories:
        if type(trajectory) is Trajectory and _PLAIN_FIELD_WRITES:
            # What pydantic's assignment does for these fields, minus its dispatch (about
            # a microsecond a field, for every trajectory of every group).
            fields = trajectory.__dict__
            if fields["initial_policy_version"] is None:
                fields["initial_policy_version"] = initial
                trajectory.__pydantic_fields_set__.add("initial_policy_version")
            if fields["final_policy_version"] is None:
                fields["final_policy_version"] = final
                trajectory.__pydantic_fields_set__.add("final_policy_version")
            version = fields["initial_policy_version"]
        else:
            if trajectory.initial_policy_version is None:
                trajectory.initial_policy_version = initial
            if trajectory.final_policy_version is None:
                trajectory.final_policy_version = final
            version = trajectory.initial_policy_version
        if oldest is None or version < oldest:
            oldest = version
    return oldest


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def copy_scenario_metadata(group: TrajectoryGroup, scenario: object) -> None:
    """Copy a dict scenario's scalar `metadata` onto the group (`scenario_id` kept as is)."""
    metadata = scenario.get("metadata") if isinstance(scenario, Mapping) else None
    if not isinstance(metadata, Mapping):
        return
    for key, value in metadata.items():
        if not isinstance(key, str) or not _is_scalar(value):
            continue
        group.metadata[key if key == "scenario_id" else f"scenario_{key}"] = value


def scenario_context(scenario: object) -> str:
    """` [scenario_id='a' epoch=1]` for a failure line, or '' when the scenario has none."""
    metadata = scenario.get("metadata") if isinstance(scenario, Mapping) else None
    if not isinstance(metadata, Mapping):
        return ""
    fields = [f"{k}={metadata[k]!r}" for k in FAILURE_CONTEXT_KEYS if k in metadata]
    return f" [{' '.join(fields)}]" if fields else ""


def average_steps_off_policy(current_step: int, versions: Iterable[int | None]) -> float:
    """Mean of `current_step - version` over a batch's groups' initial versions (None: skip)."""
    lags = [current_step - version for version in versions if version is not None]
    return sum(lags) / len(lags) if lags else 0.0


def reward_stats(group: TrajectoryGroup) -> tuple[int, float, float]:
    """A group's reward count, sum and population standard deviation, in one pass.

    Any finite rewards are valid (how far apart they may be is the backend's business): the
    deviation is reckoned on rewards scaled below 1 by a power of two, so squares of rewards
    near 1.7e308 never raise OverflowError here (the sum itself may be inf)."""
    rewards = [t.reward for t in group.trajectories]
    n = len(rewards)
    total = sum(rewards)
    if n <= 1 or not all(map(math.isfinite, rewards)):
        return n, total, 0.0 if n <= 1 else math.nan
    exponent = -math.frexp(max(map(abs, rewards)))[1]
    scaled = [math.ldexp(r, exponent) for r in rewards]
    mean = math.fsum(scaled) / n
    std = math.sqrt(math.fsum([(x - mean) ** 2 for x in scaled]) / n)
    return n, total, math.ldexp(std, -exponent)  # std <= the largest |reward|: finite


def split_eval_items(
    items: Sequence[Trajectory | TrajectoryGroup],
) -> tuple[list[TrajectoryGroup], list[Trajectory]]:
    """An eval split's groups (loose trajectories gathered into one) and all trajectories."""
    groups = [item for item in items if isinstance(item, TrajectoryGroup)]
    loose = [item for item in items if not isinstance(item, TrajectoryGroup)]
    if loose:
        groups.append(TrajectoryGroup(loose))
    return groups, [t for g in groups for t in g.trajectories]


def eval_splits(result: Any) -> dict[str, list[Trajectory | TrajectoryGroup]]:
    """An eval_fn's result as {split: items}: a bare list is the "val" split."""
    if isinstance(result, Mapping):
        return {str(k): _eval_items(v) for k, v in result.items()}
    return {"val": _eval_items(result)}


def _eval_items(items: Any) -> list[Trajectory | TrajectoryGroup]:
    """One split's items: None, as in ART, none (an eval_fn that logs on its own and returns
    nothing); one trajectory or group given bare, a list of one."""
    if items is None:
        return []
    if isinstance(items, (Trajectory, TrajectoryGroup)):  # (pydantic models iterate fields)
        return [items]
    if not isinstance(items, Iterable):
        raise TypeError(
            f"eval_fn returned {type(items).__name__}; return a list of art.Trajectory or "
            "art.TrajectoryGroup, or a dict of split name to such a list"
        )
    return list(items)
