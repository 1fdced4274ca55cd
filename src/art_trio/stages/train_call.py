"""One `backend.train` call: its keyword arguments, the call and its train row, its step.

The training stage (training.py) decides what to train and settles the outcome; this module
is the call itself, asyncio code run through the bridge: `backend.train` with the keyword
arguments the installed ART line passes, then `model.log` of the step's metrics, and the
check that the backend's step advanced by exactly one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from art import TrajectoryGroup

from ..config.settings import PipelineSettings
from ..messages.errors import BackendStepError
from ..messages.values import Delivered
from ..plumbing.compat import line_train_kwargs
from ..plumbing.hooks import backend_hook
from ..run import PipelineRun
from .metrics import StepTimes, TrainMetrics


@dataclass(slots=True)
class TrainClock:
    """Seconds the `backend.train` call took, written by the call (None until it ended)."""

    train_s: float | None = None


@dataclass(slots=True)
class CollectedBatch:
    items: list[Delivered] = field(default_factory=list)
    source_ended: bool = False
    idle_s: float = 0.0


def batch_preparation(backend: object, model: Any) -> Callable[..., Any] | None:
    """The backend's `prepare_pipeline_batch`, if it has one and says it packs this model's
    batches ahead (`supports_async_pipeline_packing(model)`, where it has that), as ART
    0.5.23 decides."""
    prepare = backend_hook(backend, "prepare_pipeline_batch")
    if not callable(prepare):
        return None
    supports = backend_hook(backend, "supports_async_pipeline_packing")
    if callable(supports) and not supports(model):
        return None
    return prepare


def train_kwargs(
    settings: PipelineSettings, *, save_checkpoint: bool, current_step: int
) -> dict[str, Any]:
    """The keyword arguments of `backend.train`, as the installed ART's trainer passes them.

    `current_step` is the step the batch trains from (the KL reference step lags it).
    """
    s = settings
    kwargs: dict[str, Any] = {
        "learning_rate": s.training.learning_rate,
        "loss_fn": s.training.loss_fn,
        "loss_fn_config": s.training.loss_fn_config,
        "normalize_advantages": s.training.normalize_advantages,
        "save_checkpoint": save_checkpoint,
        "adam_params": s.training.adam_params,
    }
    kwargs.update(
        line_train_kwargs(
            current_step=current_step,
            kl_penalty_coef=s.training.kl_penalty_coef,
            kl_penalty_reference_step=s.training.kl_penalty_reference_step,
            kl_penalty_step_lag=s.training.kl_penalty_step_lag,
            optimizer_save_interval=s.training.optimizer_save_interval,
            grad_accumulation_sequences=s.training.grad_accumulation_sequences,
        )
    )
    if s.training.packed_sequence_length is not None:
        kwargs["packed_sequence_length"] = s.training.packed_sequence_length
    return kwargs


async def train_and_log(
    run: PipelineRun,
    batch: CollectedBatch,
    groups: list[TrajectoryGroup],
    expected: int,
    eval_this_step: bool,
    step_started: float,
    metrics: TrainMetrics,
    prepared: dict[str, float],
    clock: TrainClock,
) -> Any:
    """`backend.train` on the batch's `groups`, then `model.log` of its metrics.

    Asyncio code (it awaits ART), called through the bridge. Returns the TrainResult; the
    seconds spent in `backend.train` go to `clock` (the stage reports them as an event once
    back in its own task, whether the call returned or not).
    """
    # ART's opt-in step trace, printed as ART prints it (asked for by the environment).
    ctx, settings, calls, now = run, run.settings, run.calls, run.now
    step_log = bool(os.getenv("ART_TRAIN_STEP_LOG"))
    if step_log:
        print(f"[train] step {expected} starting (batch={len(groups)})")
    save_checkpoint = settings.persistence.save_checkpoint and eval_this_step
    train_started = now()
    try:
        kwargs = train_kwargs(settings, save_checkpoint=save_checkpoint, current_step=expected - 1)
        with calls.track("training", f"backend.train (step {expected})"):
            result = await ctx.backend.train(ctx.model, groups, **kwargs)
    finally:
        train_seconds = clock.train_s = now() - train_started
        if step_log:
            print(f"[train] step {expected} done in {train_seconds:.1f}s")

    new_step = checked_step(result, expected)
    step_seconds = now() - step_started
    times = StepTimes(wall=step_seconds, collect=batch.idle_s, backend_train=train_seconds)
    row = metrics.build(batch.items, new_step, times, result.metrics)
    # What backend.prepare_pipeline_batch reported: in the row, under the train result's
    # own metrics, as ART orders them.
    row = {**prepared, **row}
    with calls.track("training", f"model.log (train row of step {new_step})"):
        await ctx.model.log(groups, split="train", step=new_step, metrics=row)
    return result


def checked_step(result: Any, expected: int) -> int:
    """The step `backend.train` reports, which must be `expected` (one more than before).

    Resume relies on it: a pending batch counts as trained when the backend's step reached the
    batch's step, so a step that does not advance makes resume train the batch again; the
    off-policy bound counts policy versions in steps, so a jump makes fresh groups look stale.
    """
    step = getattr(result, "step", None)
    if isinstance(step, bool) or not isinstance(step, int):
        raise BackendStepError(
            f"backend.train returned {type(result).__name__} with step {step!r}, not an "
            f"integer; expected step {expected}"
        )
    if step != expected:
        what = "did not advance" if step < expected else f"jumped by {step - expected + 1}"
        raise BackendStepError(
            f"backend.train trained step {expected - 1} -> {expected} but reported step "
            f"{step}: the step {what}. The trainer needs the backend's step to advance by "
            "exactly one per train call (resume asks it which batches were trained). The "
            "batch stays recorded as pending and is settled against the backend's step on "
            "resume; fix the backend's step accounting (TrainResult.step / get_step) first."
        )
    return step
