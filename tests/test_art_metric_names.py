"""The train rows a real art_trio run writes carry ART 0.5.23's metric names and meanings.

A real `art.TrainableModel` (ART's own `model.log`, its `history.jsonl`) trained by art_trio
under trio's MockClock: rollouts take 2 s, `backend.train` 1 s, every 4th scenario scores the
same on every rollout (zero variance) and two claim a policy far behind (stale). The values
logged must agree with what the doubles saw.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path
from typing import Any

import art
import pytest

import art_trio.policy.freshness
from art_trio import PipelineTrainer
from art_trio.plumbing.compat import CHECKPOINT_ROW_WALL_CLOCK, TRAIN_METRIC_NAMES
from art_trio.stages.metrics import batch_factor, weighted_percentile
from tests.doubles import HISTORY_KEYS, RecordingBackend, scenarios, trajectory

ON_0523 = pytest.mark.skipif(
    TRAIN_METRIC_NAMES != "0.5.23",
    reason="needs ART 0.5.20+ (Python 3.12+), whose metric names it checks",
)

#: Every name ART 0.5.23's trainer (or its model.log from them) writes in a train row on the
#: differential workload, `data/...` and `train/...` aside.
ART_0523_TRAIN_KEYS = {
    *(f"discarded/{kind}/{what}_groups" for kind in ("cum", "step", "rate")
      for what in ("stale", "zero_variance")),
    "offpolicy/token_weighted_policy_age_p95_steps",
    "offpolicy/token_weighted_policy_age_steps",
    "queue/actual_stale_fraction",
    "queue/completed_backlog_groups",
    "queue/freshness_pressure",
    "queue/groups_depth",
    "queue/groups_depth_max",
    "queue/occupancy",
    "queue/predicted_policy_age_mean_steps",
    "queue/predicted_policy_age_p95_steps",
    "queue/predicted_stale_fraction",
    "queue/put_wait_frac",
    "queue/put_wait_s",
    "queue/put_waiting_groups",
    "queue/ready_groups_est",
    "sample_efficiency/accepted_groups_per_step",
    "sample_efficiency/batch_factor",
    "sample_efficiency/freshness_discount",
    *(f"time/{kind}{what}" for kind in ("step_", "cum/") for what in (
        "backend_train_s", "collect_batch_s", "post_train_backpressure_s",
        "post_train_dispatch_wait_s", "rollout_idle_s", "rollout_s", "trainer_idle_s", "wall_s",
    )),
}
ZERO_VARIANCE = {3, 7, 11}
STALE = {5, 9}
N = 13
ROLLOUT_S = 2.0
TRAIN_S = 1.0


def tokens(i: int, k: int) -> int:
    return 10 + 7 * i + k


class SeeingBackend(RecordingBackend):
    """Records each batch's (initial_policy_version, completion_tokens) per trajectory."""

    def __init__(self) -> None:
        super().__init__(train_seconds=TRAIN_S)
        self.seen: dict[int, list[tuple[int, float]]] = {}

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
        groups = list(trajectory_groups)
        seen = [
            (t.initial_policy_version, float(t.metrics.get("completion_tokens", 1.0)))
            for g in groups
            for t in g.trajectories
        ]
        result = await super().train(model, groups, **kwargs)
        self.seen[result.step] = seen
        return result


async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
    await asyncio.sleep(ROLLOUT_S)
    i = scenario["i"]
    version = -10 if i in STALE else None  # art_trio stamps the others with its version
    rewards = [0.5, 0.5] if i in ZERO_VARIANCE else [0.0, 1.0]
    return art.TrajectoryGroup(
        trajectory(r, initial_policy_version=version, metrics={"completion_tokens": tokens(i, k)})
        for k, r in enumerate(rewards)
    )


def history(model: art.TrainableModel) -> list[dict[str, Any]]:
    path = Path(model._get_output_dir()) / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def run(model: art.TrainableModel, rollout_fn: Any = rollout) -> tuple[Any, Any]:
    backend = SeeingBackend()
    object.__setattr__(model, "_backend", backend)
    trainer = PipelineTrainer(
        model, backend, rollout_fn, scenarios(N), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, max_steps_off_policy=1,
    )
    await trainer.train(handle_signals=False)
    return trainer, backend


def train_rows(model: art.TrainableModel) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in history(model) if "train/reward" in row}


@ON_0523
async def test_every_train_row_has_art_0523s_names_and_the_doubles_numbers(model, autojump_clock):
    trainer, backend = await run(model)
    rows = train_rows(model)
    assert sorted(rows) == [c.step for c in backend.calls] and len(rows) >= 4
    for row in rows.values():
        assert ART_0523_TRAIN_KEYS <= set(row), ART_0523_TRAIN_KEYS - set(row)
        assert not {"train/discarded_stale_groups", "train/steps_off_policy"} & set(row)
        assert row["time/step_backend_train_s"] == pytest.approx(TRAIN_S)
        assert row["time/step_post_train_backpressure_s"] == 0.0
        assert row["time/step_wall_s"] >= row["time/step_backend_train_s"]
        assert row["time/step_collect_batch_s"] == row["time/step_trainer_idle_s"]
        assert row["time/step_wall_s"] == pytest.approx(
            row["time/step_collect_batch_s"] + TRAIN_S
        )
        # Every completed rollout took exactly ROLLOUT_S of virtual time.
        assert (row["time/step_rollout_s"] / ROLLOUT_S) == pytest.approx(
            round(row["time/step_rollout_s"] / ROLLOUT_S)
        )
        assert row["sample_efficiency/accepted_groups_per_step"] == len(
            backend.calls[row["step"] - 1].scenario_ids
        )
        assert row["queue/groups_depth_max"] >= 2  # the channel (queue_maxsize default)
        assert 0.0 <= row["queue/occupancy"] <= 1.0

    last = rows[max(rows)]
    counters = trainer.last_counters
    # Discards: exactly the groups the workload made zero-variance or stale.
    assert last["discarded/cum/zero_variance_groups"] == len(ZERO_VARIANCE)
    assert last["discarded/cum/stale_groups"] == len(STALE) == counters.stale
    for what in ("stale", "zero_variance"):
        steps = sum(r[f"discarded/step/{what}_groups"] for r in rows.values())
        assert steps == last[f"discarded/cum/{what}_groups"]
    completed = N
    assert last["discarded/rate/stale_groups"] == pytest.approx(len(STALE) / completed)
    assert last["discarded/rate/zero_variance_groups"] == pytest.approx(
        len(ZERO_VARIANCE) / completed
    )
    # ART's model.log totals every time/step_ key.
    assert last["time/cum/backend_train_s"] == pytest.approx(TRAIN_S * len(rows))
    assert last["time/cum/rollout_s"] == pytest.approx(
        sum(r["time/step_rollout_s"] for r in rows.values())
    )
    # Every rollout completed before the last step, stale and zero-variance ones included
    # (ART's workers count every group they put in the queue).
    assert last["time/cum/rollout_s"] == pytest.approx(ROLLOUT_S * N)

    # Policy age: token-weighted over the trajectories the backend was handed.
    for step, row in rows.items():
        seen = backend.seen[step]
        weight = sum(w for _, w in seen)
        mean_age = sum((step - 1 - v) * w for v, w in seen) / weight
        assert row["offpolicy/token_weighted_policy_age_steps"] == pytest.approx(mean_age)
        assert row["offpolicy/token_weighted_policy_age_p95_steps"] == weighted_percentile(
            [(float(step - 1 - v), w) for v, w in seen], 0.95
        )
        assert row["sample_efficiency/freshness_discount"] <= 1.0

    # art_trio's own measures, beside ART's (filed by model.log under train/).
    assert last["train/art_trio/cum/cancelled_rollouts"] == counters.stale_cancelled
    assert last["train/art_trio/cum/wasted_rollout_s"] == pytest.approx(
        ROLLOUT_S * len(STALE)
    )


@ON_0523
async def test_a_missing_completion_tokens_metric_counts_one_token_and_warns_once(
    model, autojump_clock, monkeypatch
):
    monkeypatch.setattr(art_trio.policy.freshness, "_warned_missing_tokens", False)

    async def untokened(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        group = await rollout(model, scenario, config)
        for t in group.trajectories:
            t.metrics.pop("completion_tokens")
        return group

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, backend = await run(model, untokened)
    missing = [w for w in caught if "completion_tokens" in str(w.message)]
    assert len(missing) == 1
    for step, row in train_rows(model).items():
        ages = [step - 1 - v for v, _ in backend.seen[step]]
        assert row["offpolicy/token_weighted_policy_age_steps"] == pytest.approx(
            sum(ages) / len(ages)
        )


async def test_checkpoint_rows_carry_a_wall_clock_only_where_art_does(model, autojump_clock):
    backend = RecordingBackend()
    object.__setattr__(model, "_backend", backend)

    async def eval_fn(model: Any, step: int, config: Any) -> list[Any]:
        return [trajectory(0.5)]

    await PipelineTrainer(
        model, backend, rollout, scenarios(4), None, eval_fn, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, eval_every_n_steps=1,
    ).train(handle_signals=False)
    rows = [row for row in history(model) if any(k.startswith("checkpoint/") for k in row)]
    assert rows
    assert all(("time/wall_clock_sec" in row) == CHECKPOINT_ROW_WALL_CLOCK for row in rows)


async def test_the_names_both_lines_share_are_in_every_train_row(model, autojump_clock):
    await run(model)
    for row in train_rows(model).values():
        # (0.5.18 logs rollout and rollout-idle seconds only when positive, as ART 0.5.18.)
        always = ("stale_groups", "step_wall_s", "trainer_idle_s", "backend_train_s")
        assert {HISTORY_KEYS[name] for name in always} <= set(row)
        assert "train/art_trio/step/cancelled_rollouts" in row


@ON_0523
def test_weighted_percentile_and_batch_factor_follow_arts_formulas() -> None:
    from art.pipeline_trainer import trainer as art_trainer

    points = [(3.0, 1.0), (0.0, 5.0), (1.0, 2.0), (2.0, 0.5)]
    for q in (0.0, 0.5, 0.9, 0.95, 1.0):
        assert weighted_percentile(points, q) == art_trainer._weighted_percentile(points, q)
    # 8 reference groups of 4 rollouts against 2 groups of 2 (ART's critical batch: 300).
    assert batch_factor(2, 2.0, (8.0, 4.0)) == pytest.approx((8 + 300 / 4) / (2 + 300 / 2))
    assert batch_factor(2, 2.0, (None, None)) == 1.0
