"""The per-step train metrics: one place that computes and names them.

The training stage logs them with `model.log(batch, split="train", metrics=...)`, as ART's
trainer does, so ART's `model.log` adds its own (`train/reward`, `data/...`, the `time/cum/...`
totals of every `time/step_...` key) and a dashboard built for ART's trainer works unchanged.
Which names depends on the installed ART line (`compat.TRAIN_METRIC_NAMES`):

ART 0.5.18 names (unchanged from before): `discarded_stale_groups` (stale and cancelled
rollouts so far), `steps_off_policy`, `time/step_wall_s`, `time/step_trainer_s`,
`time/step_actor_s`, `throughput/step_trainer_idle_s`, `throughput/step_actor_idle_s`.

ART 0.5.23 names, with art_trio's meaning where it differs in detail:

- `discarded/{cum,step,rate}/{stale,zero_variance}_groups`: completed groups discarded as stale
  or as zero variance, in this `train()` call / since the previous train row / as a share of
  all completed groups (trained + stale + zero variance). Rollouts the gate cancelled before
  they completed are not groups: they are `art_trio/.../cancelled_rollouts`.
- `time/step_wall_s` (collect + `backend.train`), `time/step_collect_batch_s` and
  `time/step_trainer_idle_s` (both: waiting for the batch), `time/step_backend_train_s`.
- `time/step_rollout_s`, `time/step_rollout_idle_s`: seconds in rollouts that completed since
  the previous train row, and idle in workers before them (gate, hand-over).
- `time/step_post_train_backpressure_s`, `time/step_post_train_dispatch_wait_s`: always 0.0.
  art_trio logs, checkpoints and publishes inline after `backend.train`; nothing runs behind
  the next step, so there is no post-train task to wait for and no dispatch fence.
- `queue/put_wait_s`, `queue/put_wait_frac`: workers blocked on a full groups channel, alone
  and as a share of that plus `time/step_rollout_s`. `queue/actual_stale_fraction`: this
  step's stale groups over the groups it took, stale or zero variance.
- `queue/groups_depth` = `queue/completed_backlog_groups` = `queue/ready_groups_est`: groups
  done and waiting for a batch after this step (in the channel and the trainer's ready pool);
  `queue/groups_depth_max`: how many can wait there; `queue/occupancy`: their ratio;
  `queue/put_waiting_groups`: workers blocked handing a group over; `queue/predicted_...`:
  those groups' policy ages at the next step (mean, p95, share over `max_steps_off_policy`,
  mean over the bound as `queue/freshness_pressure`).
- `offpolicy/token_weighted_policy_age_steps` and `..._p95_steps`: each trajectory's age (the
  step the batch trains from minus its `initial_policy_version`), weighted by its
  `completion_tokens` metric, else its served choices' token counts (one unit and a
  one-time warning where neither is known; ART stops the run).
  `sample_efficiency/{accepted_groups_per_step,batch_factor,freshness_discount}`, and
  `throughput/accepted_train_tok_per_s`, `objective/score` where the backend reports
  `data/step_trainable_assistant_tokens`: ART's formulas.

Tokens carry the version that produced them where the trajectory says so (in-flight updates:
`policy_token_spans` on served choices, ART 0.5.20+'s `_policy_token_counts`), read by
`freshness.version_tokens`. Left out: `queue/packed_*`, `time/step_batch_{selection,prepare}_s`
(ART's packing stage, which art_trio does not have, and which ART logs only when packing);
`queue/data_plane_*` and `lease_*` (ART's distributed queue); `pipeline_settings/*` (ART's
autotuner's; art_trio's writes its decisions as `autotune/...` rows, see `art_trio.autotune`).

art_trio's own, on both lines (ART's `model.log` files them as `train/art_trio/...`):
`art_trio/{step,cum}/cancelled_rollouts` (doomed rollouts the gate cancelled),
`art_trio/{step,cum}/wasted_rollout_s` (seconds in rollouts that ended stale or cancelled).
Not the gate's admission headroom: a snapshot of it costs about as much as the rest of the row,
and after a step it says little (the gate re-decides at every hand-over).

Cost: O(batch trajectories + groups waiting) per step; the rollout side only adds up seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..messages.values import Delivered
from ..observation.fates import RunCounters
from ..plumbing.compat import TRAIN_METRIC_NAMES
from ..policy.batching import average_steps_off_policy
from ..policy.freshness import tokens_by_version
from ..run import PipelineRun

#: ART 0.5.23's freshness time constant (steps) and critical rollout batch size.
FRESHNESS_TAU_STEPS = 8.0
CRITICAL_ROLLOUT_BATCH_SIZE = 300.0


@dataclass(slots=True)
class StepTimes:
    """What the training stage measured for one step, in seconds."""

    wall: float
    collect: float
    backend_train: float


def weighted_percentile(points: Sequence[tuple[float, float]], q: float) -> float:
    """The smallest value whose cumulative weight reaches `q` of the total (ART's rule)."""
    if not points:
        return 0.0
    ordered = sorted(points)
    total = sum(weight for _, weight in ordered)
    if total <= 0:
        return ordered[-1][0]
    running = 0.0
    for value, weight in ordered:
        running += weight
        if running >= q * total:
            return value
    return ordered[-1][0]


def _age_exp(age: float) -> float:
    exponent = max(age, 0.0) / FRESHNESS_TAU_STEPS
    return math.inf if exponent >= 700.0 else math.exp(exponent)


def policy_age_metrics(
    training_step: int, batch: Iterable[Delivered]
) -> tuple[dict[str, float], float | None]:
    """Token-weighted policy age of a batch trained from `training_step`.

    Returns the `offpolicy/...` metrics and the weighted mean of exp(age / tau) (None, and no
    metrics, when no trajectory carries a version). Tokens are summed per version first, so
    the ages and exponentials are computed once per version, not per trajectory.
    """
    tokens = tokens_by_version(item.group for item in batch)
    if not tokens:
        return {}, None
    # A version newer than the trainer's never gets here: the rollout stage stops the run on
    # it (batching.FuturePolicyError), as ART does. Clamped all the same.
    points = [(float(max(0, training_step - v)), w) for v, w in tokens.items()]
    weight_sum = sum(w for _, w in points)
    age_sum = sum(age * w for age, w in points)
    exp_sum = sum(_age_exp(age) * w for age, w in points)
    return {
        "offpolicy/token_weighted_policy_age_steps": age_sum / weight_sum,
        "offpolicy/token_weighted_policy_age_p95_steps": weighted_percentile(points, 0.95),
    }, exp_sum / weight_sum


def batch_factor(
    groups: int, rollouts_per_group: float | None, references: tuple[float | None, float | None]
) -> float:
    """ART's `sample_efficiency/batch_factor`: the reference batch's data over this one's."""
    reference_groups, reference_rollouts = references
    if reference_groups is None or groups <= 0 or not rollouts_per_group:
        return 1.0
    reference_rollouts = reference_rollouts or rollouts_per_group
    reference = reference_groups + CRITICAL_ROLLOUT_BATCH_SIZE / reference_rollouts
    return reference / (groups + CRITICAL_ROLLOUT_BATCH_SIZE / rollouts_per_group)


class TrainMetrics:
    """Builds each train row's metrics; remembers the run totals the previous row saw."""

    def __init__(
        self, run: PipelineRun, *, ready: list[Delivered], ready_capacity: Callable[[], int]
    ) -> None:
        self._counters = run.counters
        #: The persisted tallies as this run found them (earlier runs' share of the totals).
        self._tally_base = run.tally_base
        self._score_references = run.score_references
        self._freshness = run.freshness
        self._receive = run.groups.receive_end
        #: The training stage's ready pool (its groups wait for a batch too).
        self._ready = ready
        self._ready_capacity = ready_capacity
        self._seen = _Totals()

    def build(
        self,
        batch: Sequence[Delivered],
        new_step: int,
        times: StepTimes,
        result_metrics: Mapping[str, float],
    ) -> dict[str, float]:
        totals = _Totals.of(self._counters)
        step = totals.minus(self._seen)
        self._seen = totals
        if TRAIN_METRIC_NAMES == "0.5.23":
            metrics = self._art_0523(batch, times, totals, step)
            metrics.update(result_metrics)
            metrics.update(self._score(batch, new_step, times, metrics))
            metrics.update(self._queue(new_step))
        else:
            metrics = _art_0518(self._counters, batch, new_step, times)
            metrics.update(result_metrics)
        metrics["art_trio/step/cancelled_rollouts"] = float(step.cancelled)
        metrics["art_trio/cum/cancelled_rollouts"] = float(totals.cancelled)
        metrics["art_trio/step/wasted_rollout_s"] = step.wasted_s
        metrics["art_trio/cum/wasted_rollout_s"] = totals.wasted_s
        return metrics

    def _art_0523(
        self,
        batch: Sequence[Delivered],
        times: StepTimes,
        totals: _Totals,
        step: _Totals,
    ) -> dict[str, float]:
        # Cumulative over the whole run, earlier train() calls included (ART persists them).
        base = self._tally_base
        accepted = base.accepted + self._counters.trained + len(batch)  # batch not counted
        stale, zero_variance = base.stale + totals.stale, base.zero_variance + totals.zero_variance
        completed = max(float(accepted + stale + zero_variance), 1.0)
        taken = max(len(batch) + step.stale + step.zero_variance, 1)
        return {
            "discarded/cum/stale_groups": float(stale),
            "discarded/cum/zero_variance_groups": float(zero_variance),
            "discarded/step/stale_groups": float(step.stale),
            "discarded/step/zero_variance_groups": float(step.zero_variance),
            "discarded/rate/stale_groups": stale / completed,
            "discarded/rate/zero_variance_groups": zero_variance / completed,
            "time/step_wall_s": times.wall,
            "time/step_collect_batch_s": times.collect,
            "time/step_trainer_idle_s": times.collect,
            "time/step_rollout_s": step.rollout_s,
            "time/step_rollout_idle_s": step.rollout_idle_s,
            "time/step_backend_train_s": times.backend_train,
            "time/step_post_train_backpressure_s": 0.0,
            "time/step_post_train_dispatch_wait_s": 0.0,
            "queue/put_wait_s": step.put_wait_s,
            "queue/put_wait_frac": step.put_wait_s / max(step.put_wait_s + step.rollout_s, 1e-9),
            "queue/actual_stale_fraction": step.stale / taken,
        }

    def _score(
        self,
        batch: Sequence[Delivered],
        new_step: int,
        times: StepTimes,
        so_far: Mapping[str, float],
    ) -> dict[str, float]:
        sizes = [len(item.group.trajectories) for item in batch]
        per_group = sum(sizes) / len(sizes) if sizes else None
        factor = batch_factor(len(batch), per_group, self._score_references)
        metrics = {
            "sample_efficiency/accepted_groups_per_step": float(len(batch)),
            "sample_efficiency/batch_factor": factor,
        }
        # The batch trained from the policy one step before the one it produced.
        ages, exp_moment = policy_age_metrics(new_step - 1, batch)
        metrics.update(ages)
        if exp_moment is None:
            return metrics
        freshness = 1.0 / max(exp_moment, 1e-12)
        metrics["sample_efficiency/freshness_discount"] = freshness
        tokens = so_far.get("data/step_trainable_assistant_tokens")
        if tokens is not None and times.wall > 0:
            per_second = float(tokens) / times.wall
            metrics["throughput/accepted_train_tok_per_s"] = per_second
            metrics["objective/score"] = per_second * freshness * factor
        return metrics

    def _queue(self, new_step: int) -> dict[str, float]:
        stats = self._receive.statistics()
        waiting = [*self._ready, *self._receive.queue.queued()]
        depth = float(len(self._ready) + stats.current_buffer_used)
        capacity = float(stats.max_buffer_size + self._ready_capacity())
        fresh = self._freshness
        # As ART: against the mean bound where set (with mean ages), else the hard bound.
        mean_bound = fresh.limit_mean_steps_off_policy
        bound = mean_bound if mean_bound is not None else fresh.max_steps_off_policy
        limit = max(float(bound if bound is not None else 1.0), 1e-9)
        ages = [
            float(new_step - version)
            for version in (
                item.mean_version if mean_bound is not None and item.mean_version is not None
                else item.version
                for item in waiting
            )
            if version is not None
        ]
        mean = sum(ages) / len(ages) if ages else 0.0
        return {
            "queue/ready_groups_est": depth,
            "queue/completed_backlog_groups": depth,
            "queue/put_waiting_groups": float(stats.tasks_waiting_send),
            "queue/groups_depth": depth,
            "queue/groups_depth_max": capacity,
            "queue/occupancy": depth / max(capacity, 1.0),
            "queue/predicted_policy_age_mean_steps": mean,
            "queue/predicted_policy_age_p95_steps": weighted_percentile(
                [(age, 1.0) for age in ages], 0.95
            ),
            "queue/freshness_pressure": mean / limit,
            "queue/predicted_stale_fraction": (
                sum(1 for age in ages if age > limit) / len(ages) if ages else 0.0
            ),
        }


def _art_0518(
    counters: RunCounters, batch: Sequence[Delivered], new_step: int, times: StepTimes
) -> dict[str, float]:
    actor_s = sum(item.rollout_wall_s for item in batch)
    actor_idle_s = sum(item.actor_idle_s for item in batch)
    metrics: dict[str, float] = {
        "discarded_stale_groups": float(counters.stale),
        "steps_off_policy": average_steps_off_policy(new_step, (item.version for item in batch)),
        "time/step_wall_s": times.wall,
        "throughput/step_trainer_idle_s": times.collect,
        "time/step_trainer_s": times.backend_train,
    }
    if actor_s > 0:
        metrics["time/step_actor_s"] = actor_s
    if actor_idle_s > 0:
        metrics["throughput/step_actor_idle_s"] = actor_idle_s
    return metrics


class _Totals(NamedTuple):
    """Run totals the train rows report, or their increase since the previous row."""

    stale: int = 0
    zero_variance: int = 0
    cancelled: int = 0
    rollout_s: float = 0.0
    rollout_idle_s: float = 0.0
    put_wait_s: float = 0.0
    wasted_s: float = 0.0

    @classmethod
    def of(cls, c: RunCounters) -> _Totals:
        return cls(
            c.stale - c.stale_cancelled,
            c.zero_variance,
            c.stale_cancelled,
            c.rollout_s,
            c.rollout_idle_s,
            c.put_wait_s,
            c.stale_rollout_s + c.cancelled_rollout_s,
        )

    def minus(self, before: _Totals) -> _Totals:
        return _Totals._make(now - then for now, then in zip(self, before, strict=True))
