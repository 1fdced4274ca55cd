"""ART 0.5.20's mean policy-age bound (`limit_mean_steps_off_policy`), with or without the
hard bound (`max_steps_off_policy=None` turns it off)."""

from __future__ import annotations

from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.policy.batching import UNBOUNDED_STEPS, Freshness
from art_trio.policy.freshness import mean_policy_version
from tests.doubles import RecordingBackend, scenarios, served_trajectory, trajectory


def test_freshness_rules() -> None:
    hard = Freshness(2)
    assert hard.window == 2 and not hard.is_stale(3, None, 5) and hard.is_stale(2, None, 5)
    mean = Freshness(None, 1.5)
    assert mean.window == 1 and mean.queue_window == 2 and mean.retention_window == 2
    assert not mean.is_stale(4, None, 5) and mean.is_stale(3, None, 5)  # age 2 > 1.5
    # A group mixing versions: its oldest trajectory is 3 behind, its mean only 1.
    assert not mean.is_stale(2, 4.0, 5) and Freshness(2, 1.5).is_stale(2, 4.0, 5)
    both = Freshness(3, 1.0)
    assert both.window == 1 and both.queue_window == 3
    neither = Freshness(None, None)
    assert neither.window == UNBOUNDED_STEPS and not neither.is_stale(0, 0.0, 10**6 - 1)
    assert neither.queue_window == 1 and neither.retention_window == 0


def test_the_mean_weighs_versions_by_tokens_and_spans() -> None:
    old, new = trajectory(0.0), trajectory(1.0)
    old.initial_policy_version, new.initial_policy_version = 2, 6
    old.metrics["completion_tokens"], new.metrics["completion_tokens"] = 30, 10
    assert mean_policy_version(art.TrajectoryGroup([old, new])) == pytest.approx(3.0)
    # Served per-token versions win over the trajectory's start version.
    spanned = served_trajectory(1.0, step=7)
    spanned.initial_policy_version = 1
    assert mean_policy_version(art.TrajectoryGroup([spanned])) == pytest.approx(7.0)
    assert mean_policy_version(art.TrajectoryGroup([])) is None


@pytest.mark.parametrize("max_steps_off_policy", [None, 3])
async def test_no_trained_group_breaks_the_mean_bound(
    model: Any, autojump_clock: trio.testing.MockClock, max_steps_off_policy: int | None
) -> None:
    """Slow rollouts against a mean bound of 1: every trained group is at most 1 step old."""
    backend = RecordingBackend(train_seconds=1.0)
    object.__setattr__(model, "_backend", backend)
    seen: list[tuple[int, list[int | None]]] = []
    original = backend.train

    async def train(model_: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        seen.append(
            (backend.step, [t.initial_policy_version for g in groups for t in g.trajectories])
        )
        return await original(model_, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        import asyncio

        await asyncio.sleep(0.5 + 1.7 * (scenario["i"] % 4))
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(40), None, num_rollout_workers=6,
        min_batch_size=2, max_batch_size=2, max_steps_off_policy=max_steps_off_policy,
        limit_mean_steps_off_policy=1.0,
    )
    await trainer.train(handle_signals=False)
    assert len(seen) >= 5
    for step, versions in seen:
        assert all(v is not None and step - v <= 1 for v in versions), (step, versions)
    counters = trainer.last_counters
    assert counters is not None and counters.trained == 2 * len(seen)
