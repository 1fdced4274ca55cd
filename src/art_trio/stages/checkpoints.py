"""Checkpoint bookkeeping after each training step (what ART 0.5.18's trainer added).

- a `checkpoint/saved` event in the model's `history.jsonl` when the step left a checkpoint;
- `backend.prune_model_adapters(model, retain_steps=...)`, when the backend has it, keeping
  the steps that `max_steps_off_policy` still lets rollouts sample from;
- the retention strategy, which may delete checkpoints nothing needs any more (never the
  current step, one leased or awaiting eval, or the KL penalty's reference).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..plumbing.compat import CHECKPOINT_ROW_WALL_CLOCK
from ..plumbing.hooks import backend_hook
from ..policy.retention import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointInfo,
    CheckpointRetentionContext,
)
from ..run import PipelineRun


def _output_dir(model: Any) -> Path:
    return Path(model._get_output_dir())


def append_checkpoint_event(model: Any, step: int, metrics: dict[str, float]) -> None:
    """Append one `checkpoint/...` row to history.jsonl, in the shape ART's `model.log` uses."""
    row: dict[str, Any] = {
        (k if k.startswith("checkpoint/") else f"checkpoint/{k}"): v
        for k, v in metrics.items()
        if not (isinstance(v, float) and math.isnan(v))
    }
    if not row:
        return
    # ART 0.5.18 stamps its checkpoint rows with the run's wall clock; 0.5.23 no longer
    # does, although its models still record `_run_start_time` (see compat.py).
    _append_history_row(model, row, step, wall_clock=CHECKPOINT_ROW_WALL_CLOCK)


def append_metrics_row(model: Any, prefix: str, step: int, metrics: dict[str, float]) -> None:
    """Append one row of `prefix`-named metrics to history.jsonl (as `model.log` shapes them)."""
    row: dict[str, Any] = {
        f"{prefix}{k}": v
        for k, v in metrics.items()
        if not (isinstance(v, float) and not math.isfinite(v))
    }
    _append_history_row(model, row, step)


def _append_history_row(
    model: Any, row: dict[str, Any], step: int, *, wall_clock: bool = False
) -> None:
    """Stamp `row` with its step (and the run's wall clock) and append it to history.jsonl."""
    started = getattr(model, "_run_start_time", None) if wall_clock else None
    row["training_step"] = step
    if isinstance(started, (int, float)):
        row["time/wall_clock_sec"] = time.time() - started
    row["step"] = step
    row["recorded_at"] = datetime.now().isoformat()
    out = _output_dir(model)
    os.makedirs(out, exist_ok=True)
    with open(out / "history.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def note_eval_completed(model: Any, step: int) -> None:
    append_checkpoint_event(model, step, {CHECKPOINT_EVAL_COMPLETED_METRIC: 1.0})


def _checkpoint_path(run: PipelineRun, result: Any, step: int) -> Path:
    path = getattr(result, "checkpoint_path", None)
    if isinstance(path, str) and path:
        return Path(path)
    return _output_dir(run.model) / "checkpoints" / f"{step:04d}"


async def after_step(run: PipelineRun, result: Any, step: int) -> None:
    path = _checkpoint_path(run, result, step)
    if path.exists():
        append_checkpoint_event(
            run.model,
            step,
            {CHECKPOINT_SAVED_METRIC: 1.0, CHECKPOINT_CREATED_AT_METRIC: path.stat().st_ctime},
        )
    prune = backend_hook(run.backend, "prune_model_adapters")
    if prune is not None:
        oldest = max(0, step - run.freshness.retention_window)
        with run.calls.track("training", "backend.prune_model_adapters (checkpoint hook)"):
            await run.bridge.call(
                prune, run.model, retain_steps=set(range(oldest, step + 1))
            )
    await apply_retention(run, step)


def _history_metrics_by_step(run: PipelineRun) -> dict[int, dict[str, float]]:
    """Mean of every numeric history value, per step (a step can have several rows)."""
    path = _output_dir(run.model) / "history.jsonl"
    sums: dict[int, dict[str, list[float]]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = row.get("step")
        if not isinstance(step, int):
            continue
        per_step = sums.setdefault(step, {})
        for key, value in row.items():
            if key in ("step", "recorded_at") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                per_step.setdefault(key, []).append(float(value))
    return {s: {k: sum(v) / len(v) for k, v in m.items()} for s, m in sums.items()}


def checkpoint_infos(run: PipelineRun) -> list[CheckpointInfo]:
    directory = _output_dir(run.model) / "checkpoints"
    if not directory.is_dir():
        return []
    history = _history_metrics_by_step(run)
    infos = []
    for path in directory.iterdir():
        if not (path.is_dir() and path.name.isdigit()):
            continue
        step = int(path.name)
        metrics = history.get(step, {})
        created = metrics.get(CHECKPOINT_CREATED_AT_METRIC, path.stat().st_ctime)
        infos.append(
            CheckpointInfo(
                step=step,
                path=str(path),
                created_at=datetime.fromtimestamp(created, UTC),
                is_eval_step=(
                    step in run.state.completed_eval_steps
                    or metrics.get(CHECKPOINT_EVAL_COMPLETED_METRIC, 0.0) > 0.0
                    or any(k.startswith(("val/", "test/")) for k in metrics)
                ),
                metrics=metrics,
            )
        )
    return sorted(infos, key=lambda info: info.step)


def protected_steps(run: PipelineRun, current_step: int) -> set[int]:
    """Checkpoints retention must keep: current, leased by a rollout or eval, awaiting eval,
    and the KL penalty's reference (see `kl_reference_steps`)."""
    return (
        {current_step}
        | set(run.leases.held)
        | set(run.state.pending_eval_steps)
        | kl_reference_steps(run.settings, current_step)
    )


def kl_reference_steps(settings: Any, current_step: int) -> set[int]:
    """The checkpoints the KL penalty reads, now or in the steps to come, after `current_step`.

    ART 0.5.23's rule, on every line: with `kl_penalty_coef > 0`, step 0 (the default
    reference), or with `kl_penalty_step_lag` the whole window from `current_step - lag`
    (floored at 0) up, since each later step's reference moves into it. art_trio's explicit
    `kl_penalty_reference_step` is that one step. Deleting one of them would leave
    `backend.train` without the reference it is asked to use.
    """
    if settings.training.kl_penalty_coef <= 0.0:
        return set()
    if settings.training.kl_penalty_reference_step is not None:
        return {settings.training.kl_penalty_reference_step}
    lag = settings.training.kl_penalty_step_lag
    if lag is None:
        return {0}
    return set(range(max(0, current_step - lag), current_step + 1))


async def apply_retention(run: PipelineRun, step: int) -> None:
    strategy = run.settings.persistence.checkpoint_retention_strategy
    if strategy is None or step % run.settings.persistence.checkpoint_retention_interval != 0:
        return
    infos = checkpoint_infos(run)
    protected = protected_steps(run, step)
    eligible = [info for info in infos if info.step not in protected]
    if not eligible:
        return
    eligible_steps = {info.step for info in eligible}
    keep = set(strategy(CheckpointRetentionContext(current_step=step, checkpoints=eligible)))
    delete = eligible_steps - keep
    if not delete:
        return
    steps_to_keep = sorted({info.step for info in infos} - delete)
    with run.calls.track("training", "backend._delete_checkpoint_files (checkpoint hook)"):
        await run.bridge.call(run.backend._delete_checkpoint_files, run.model, steps_to_keep)
