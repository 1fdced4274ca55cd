"""Checkpoint retention: which saved checkpoints a run keeps (ART 0.5.18's vocabulary).

A strategy sees only the checkpoints the trainer may delete (never the current step, one a
rollout or eval holds a lease on, one scheduled for eval, or the KL penalty's reference with
`kl_penalty_coef > 0`) and returns the steps to keep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from pydantic import BaseModel, Field

CHECKPOINT_SAVED_METRIC = "checkpoint/saved"
CHECKPOINT_CREATED_AT_METRIC = "checkpoint/created_at_unix"
CHECKPOINT_EVAL_COMPLETED_METRIC = "checkpoint/eval_completed"


class CheckpointInfo(BaseModel):
    """One checkpoint directory on disk and what the run's history says about its step."""

    step: int
    path: str
    created_at: datetime
    is_eval_step: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)


class CheckpointRetentionContext(BaseModel):
    """What a retention strategy decides over: the deletable checkpoints at `current_step`."""

    current_step: int
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)


CheckpointRetentionStrategy = Callable[[CheckpointRetentionContext], Iterable[int]]
"""Returns the steps, among `context.checkpoints`, to keep; every other one is deleted."""


def keep_recent_and_top(
    *, recent: int = 5, top: int = 2, metric: str = "val/reward"
) -> CheckpointRetentionStrategy:
    """Keep the `recent` newest checkpoints and the `top` best by `metric` (higher is better).

    Ties on the metric keep the later step.
    """
    if recent < 0:
        raise ValueError("recent must be >= 0")
    if top < 0:
        raise ValueError("top must be >= 0")

    def strategy(context: CheckpointRetentionContext) -> set[int]:
        by_step = sorted(context.checkpoints, key=lambda c: c.step)
        # [-recent:] is all of them when there are fewer than `recent`.
        keep = {c.step for c in by_step[-recent:]} if recent else set()
        scored = [c for c in context.checkpoints if metric in c.metrics]
        scored.sort(key=lambda c: (c.metrics[metric], c.step), reverse=True)
        keep.update(c.step for c in scored[:top])
        return keep

    return strategy


__all__ = [
    "CHECKPOINT_CREATED_AT_METRIC",
    "CHECKPOINT_EVAL_COMPLETED_METRIC",
    "CHECKPOINT_SAVED_METRIC",
    "CheckpointInfo",
    "CheckpointRetentionContext",
    "CheckpointRetentionStrategy",
    "keep_recent_and_top",
]
