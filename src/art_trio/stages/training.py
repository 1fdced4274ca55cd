"""The training stage: collect a batch, train it, log it, publish the new policy version.

Batch collection follows the reference: wait for `min_batch_size` usable groups, then take
whatever is already queued up to `max_batch_size`. Stale groups are discarded and counted;
zero-variance groups are held and logged (split "discarded") after the next step; too many
held at once stops the run as collapsed. A stop abandons collection (the groups go back to the
source on resume) but never interrupts a `backend.train` call already running.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from art import TrajectoryGroup

from ..batching import all_failed_error, is_zero_variance
from ..compat import line_train_kwargs
from ..metrics import StepTimes, TrainMetrics
from ..run import Delivered, PipelineRun
from ..settings import PipelineSettings
from .checkpoints import after_step

#: The "discarded" split logs at most this many held zero-variance groups per step (0.5.18).
MAX_DISCARDED_GROUPS_LOGGED = 50

COLLAPSE_MESSAGE = """
========================================
MODEL COLLAPSE DETECTED - Training stopped
========================================

{limit} trajectory groups in a row came back with zero reward variance: every rollout of a
scenario scored the same, so there is nothing left to learn from, which usually means the
policy has collapsed onto one degenerate answer.

Things that help:
  - a lower learning rate, so updates are less violent
  - a reward with more spread (partial credit instead of pass/fail)
  - more varied prompts, so the policy meets situations it has not collapsed on
  - smaller batches, so the policy is corrected more often

To let the run continue regardless, raise `discard_queue_multiplier` (now
{multiplier}; the run stops at {multiplier} * min_batch_size = {limit} held groups).
"""


@dataclass(slots=True)
class CollectedBatch:
    items: list[Delivered] = field(default_factory=list)
    stale: int = 0
    source_ended: bool = False
    idle_s: float = 0.0


async def training_stage(
    run: PipelineRun,
    receive: MemoryObjectReceiveStream[Delivered],
    eval_send: MemoryObjectSendStream[int],
) -> None:
    try:
        async with receive, eval_send:
            await _train_until_done(run, receive, eval_send)
    finally:
        if not run.stopping:
            # Ended on its own (max_steps, end of source, collapse): rollouts still in flight
            # can no longer be trained, so cancel them now rather than wait for them.
            run.end_rollouts_now()
        run.stage_done("training")


async def _train_until_done(
    run: PipelineRun,
    receive: MemoryObjectReceiveStream[Delivered],
    eval_send: MemoryObjectSendStream[int],
) -> None:
    settings = run.settings
    step = run.start_step
    # What can wait for a batch after one is taken: the channel, and the ready pool's rest.
    metrics = TrainMetrics(
        run, receive, ready_capacity=_lookahead(settings) - settings.max_batch_size
    )
    # Counted by the trainer itself, not read off the backend's step (which is checked too,
    # see `checked_step`): max_steps bounds the number of train calls whatever it reports.
    steps_done = 0
    while (settings.max_steps is None or steps_done < settings.max_steps) and not run.stopping:
        step_started = run.now()
        batch = await collect_batch(run, receive, step)
        if batch is None or not batch.items:
            return
        step = await _train_step(run, batch, step, eval_send, step_started, metrics)
        steps_done += 1
        if batch.source_ended and not run.ready:
            return


async def collect_batch(
    run: PipelineRun, receive: MemoryObjectReceiveStream[Delivered], current_step: int
) -> CollectedBatch | None:
    """The next batch, or None if the run stopped or collapsed while collecting.

    Waits until `min_batch_size` usable groups are ready, then takes what is ready up to
    `max_batch_size`. In "staleness_aware" mode the trainer looks at up to a channel's worth
    of ready groups and takes the oldest policy versions first (earliest deadline first): a
    newer group can wait for the next batch, an older one may not get another chance. The rest
    stay ready, in `run.ready`, for the next batch. In "eager" mode it takes them in arrival
    order, as the reference does.
    """
    settings = run.settings
    earliest_deadline_first = settings.admission == "staleness_aware"
    lookahead = _lookahead(settings)
    stale = run.stale_for(current_step)
    batch = CollectedBatch()
    ready = run.ready
    started = run.now()
    # Groups that aged out of the window while they waited for a batch.
    for item in [item for item in ready if stale(item)]:
        ready.remove(item)
        _discard_stale(run, item, batch)
    with anyio.CancelScope() as scope:
        run.collect_scope = scope
        if run.stopping:
            scope.cancel()
        if not _receive_ready(run, receive, stale, batch, lookahead):
            return None
        while len(ready) < settings.min_batch_size and not batch.source_ended:
            try:
                item = await receive.receive()
            except anyio.EndOfStream:
                batch.source_ended = True
                break
            if not _accept(run, item, stale, batch):
                return None
        if not _receive_ready(run, receive, stale, batch, lookahead):
            return None
    run.collect_scope = None
    if scope.cancel_called:
        # Stopped while collecting: the ready groups are neither trained nor resolved, so
        # a resumed run rolls their scenarios again.
        return None
    if earliest_deadline_first:
        ready.sort(key=_deadline)  # stable: arrival order among equal versions
    batch.items = ready[: settings.max_batch_size]
    del ready[: settings.max_batch_size]
    batch.idle_s = run.now() - started
    if batch.stale:
        run.status.note_stale(batch.stale)
    return batch


def _lookahead(settings: PipelineSettings) -> int:
    """How many groups the trainer holds out of the channel: bounded, so backpressure on the
    rollout workers still works."""
    if settings.admission == "staleness_aware":
        return max(settings.max_batch_size, settings.groups_capacity)
    return settings.max_batch_size


def _deadline(item: Delivered) -> tuple[float, int]:
    return (float("inf") if item.version is None else item.version, item.scenario_index)


def _receive_ready(
    run: PipelineRun,
    receive: MemoryObjectReceiveStream[Delivered],
    stale: Callable[[Delivered], bool],
    batch: CollectedBatch,
    lookahead: int,
) -> bool:
    """Move groups waiting in the channel to `run.ready`, up to `lookahead`; False on collapse."""
    while not batch.source_ended and len(run.ready) < lookahead:
        try:
            item = receive.receive_nowait()
        except anyio.WouldBlock:
            return True
        except anyio.EndOfStream:
            batch.source_ended = True
            return True
        if not _accept(run, item, stale, batch):
            return False
    return True


def _discard_stale(run: PipelineRun, item: Delivered, batch: CollectedBatch) -> None:
    run.gate.group_discarded()
    run.counters.stale += 1
    run.counters.stale_rollout_s += item.rollout_wall_s
    batch.stale += 1
    run.state.ledger.resolve(item.scenario_index)


def _accept(
    run: PipelineRun, item: Delivered, stale: Callable[[Delivered], bool], batch: CollectedBatch
) -> bool:
    """Sort one received group into the ready pool or a discard pile; False on collapse."""
    group, counters = item.group, run.counters
    counters.received += 1
    run.status.note_group_dequeued(group)
    error = all_failed_error(group)
    if error is not None:
        raise error
    if stale(item):
        _discard_stale(run, item, batch)
        return True
    if is_zero_variance(group):
        run.gate.group_discarded()
        counters.zero_variance += 1
        if not group.trajectories:
            _note_empty_group(run, item)
        run.status.note_zero_variance_discarded(1)
        run.state.ledger.resolve(item.scenario_index)
        run.held_zero_variance.append(group)
        if len(run.held_zero_variance) >= run.settings.discard_limit:
            run.collapsed = True
            print(
                COLLAPSE_MESSAGE.format(
                    limit=run.settings.discard_limit,
                    multiplier=run.settings.discard_queue_multiplier,
                )
            )
            return False
        return True
    run.ready.append(item)
    return True


def _note_empty_group(run: PipelineRun, item: Delivered) -> None:
    """A group with no trajectories (and no exceptions): zero variance, as in ART, but said.

    Counting it silently let a rollout_fn that only returned empty groups use up a whole
    source without training a step and return normally.
    """
    run.counters.empty_groups += 1
    if run.counters.empty_groups == 1:
        warnings.warn(
            f"rollout_fn returned an art.TrajectoryGroup with no trajectories for scenario "
            f"index {item.scenario_index}; it is discarded as zero variance (nothing to learn "
            "from). If every group is empty, rollout_fn is not returning its trajectories; "
            "the run's total is in trainer.last_counters.empty_groups.",
            RuntimeWarning,
            stacklevel=2,
        )


def train_kwargs(
    run: PipelineRun, *, save_checkpoint: bool, current_step: int
) -> dict[str, Any]:
    """The keyword arguments of `backend.train`, as the installed ART's trainer passes them.

    `current_step` is the step the batch trains from (the KL reference step lags it).
    """
    s = run.settings
    kwargs: dict[str, Any] = {
        "learning_rate": s.learning_rate,
        "loss_fn": s.loss_fn,
        "loss_fn_config": s.loss_fn_config,
        "normalize_advantages": s.normalize_advantages,
        "save_checkpoint": save_checkpoint,
        "adam_params": s.adam_params,
    }
    kwargs.update(
        line_train_kwargs(
            current_step=current_step,
            kl_penalty_coef=s.kl_penalty_coef,
            kl_penalty_reference_step=s.kl_penalty_reference_step,
            kl_penalty_step_lag=s.kl_penalty_step_lag,
            optimizer_save_interval=s.optimizer_save_interval,
            grad_accumulation_sequences=s.grad_accumulation_sequences,
        )
    )
    if s.packed_sequence_length is not None:
        kwargs["packed_sequence_length"] = s.packed_sequence_length
    return kwargs


def should_eval(run: PipelineRun, step: int) -> bool:
    every = run.settings.eval_every_n_steps
    if run.eval_fn is None or every <= 0:
        return False
    return step - run.state.last_eval_step >= every


async def _train_step(
    run: PipelineRun,
    batch: CollectedBatch,
    current_step: int,
    eval_send: MemoryObjectSendStream[int],
    step_started: float,
    metrics: TrainMetrics,
) -> int:
    expected = current_step + 1
    eval_this_step = should_eval(run, expected)
    groups = [item.group for item in batch.items]
    run.gate.begin_training(expected, batch_size=len(groups))
    # Written before the call: if the process dies inside backend.train, resume asks the
    # backend whether this step happened and either counts these scenarios or rolls them again.
    run.state.ledger.begin_batch(expected, (item.scenario_index for item in batch.items))
    run.state.training_step = current_step
    run.persist()

    run.status.note_training_start(len(groups))
    try:
        # backend.train and model.log are both asyncio code: one crossing of the bridge for
        # the two (under trio each trio-asyncio crossing costs ~40 us).
        result = await run.bridge.call(
            _train_and_log, run, batch, groups, expected, eval_this_step, step_started, metrics
        )
        new_step = int(result.step)
        await _log_held_zero_variance(run, new_step)

        run.state.ledger.commit_batch()
        run.state.training_step = new_step
        counters = run.counters
        counters.steps += 1
        counters.trained += len(groups)
        # Trained from policy version new_step - 1; unversioned groups count as fresh.
        counters.staleness.update(
            0 if item.version is None else new_step - 1 - item.version for item in batch.items
        )
        if eval_this_step:
            run.scheduled_eval_steps.add(new_step)
            run.state.last_eval_step = new_step
            eval_send.send_nowait(new_step)
        await after_step(run, result, new_step)
    finally:
        run.status.note_training_end()
    run.gate.publish(new_step)
    return new_step


async def _train_and_log(
    run: PipelineRun,
    batch: CollectedBatch,
    groups: list[TrajectoryGroup],
    expected: int,
    eval_this_step: bool,
    step_started: float,
    metrics: TrainMetrics,
) -> Any:
    """`backend.train` on the batch's `groups`, then `model.log` of its metrics.

    Asyncio code (it awaits ART), called through the bridge. Returns the TrainResult.
    """
    step_log = bool(os.getenv("ART_TRAIN_STEP_LOG"))
    if step_log:
        print(f"[train] step {expected} starting (batch={len(groups)})")
    save_checkpoint = run.settings.save_checkpoint and eval_this_step
    train_started = run.now()
    try:
        kwargs = train_kwargs(run, save_checkpoint=save_checkpoint, current_step=expected - 1)
        result = await run.backend.train(run.model, groups, **kwargs)
    finally:
        train_seconds = run.now() - train_started
        if step_log:
            print(f"[train] step {expected} done in {train_seconds:.1f}s")

    new_step = checked_step(result, expected)
    step_seconds = run.now() - step_started
    run.status.note_training_batch(groups, step=new_step, step_seconds=step_seconds)
    times = StepTimes(wall=step_seconds, collect=batch.idle_s, backend_train=train_seconds)
    row = metrics.build(batch.items, new_step, times, result.metrics)
    await run.model.log(groups, split="train", step=new_step, metrics=row)
    return result


class BackendStepError(RuntimeError):
    """`backend.train` reported a step other than the one after the step it trained from."""


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


async def _log_held_zero_variance(run: PipelineRun, step: int) -> None:
    if not run.held_zero_variance:
        return
    held = run.held_zero_variance[:MAX_DISCARDED_GROUPS_LOGGED]
    run.held_zero_variance.clear()
    await run.bridge.call(run.model.log, held, split="discarded", step=step)


__all__ = [
    "COLLAPSE_MESSAGE",
    "BackendStepError",
    "CollectedBatch",
    "checked_step",
    "collect_batch",
    "train_kwargs",
    "training_stage",
]
