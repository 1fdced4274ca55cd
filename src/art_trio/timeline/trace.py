"""The Trace Event JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Process 1 holds the rollout lanes (a thread per worker slot), process 2 the trainer: training
calls, evals and stalls on their own threads. Rollouts, calls, evals and stalls are complete
events ("X", `ts`/`dur` in microseconds since the run started) with their facts as `args`;
each policy publish is a global instant event ("i"). The format:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .model import RunTimeline, StepAges

_ROLLOUTS, _TRAINER = 1, 2
_TRAIN_TID, _EVAL_TID, _STALL_TID = 1, 2, 3


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(pid: int, tid: int | None, name: str) -> dict[str, Any]:
    if tid is None:
        return {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _slice(
    pid: int, tid: int, cat: str, name: str, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    """A complete event ("X"): `start` and `end` in seconds since the run started."""
    span = {"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": name}
    return {**span, "ts": _us(start), "dur": _us(end - start), "args": args}


def trace_events(run: RunTimeline) -> dict[str, Any]:
    """The run as a Trace Event JSON object (`{"traceEvents": [...], ...}`)."""
    t0 = run.start
    events: list[dict[str, Any]] = [
        _meta(_ROLLOUTS, None, f"{run.trainer}: rollout workers"),
        _meta(_TRAINER, None, f"{run.trainer}: trainer"),
        _meta(_TRAINER, _TRAIN_TID, "backend.train"),
        _meta(_TRAINER, _EVAL_TID, "eval"),
        _meta(_TRAINER, _STALL_TID, "stalls"),
    ]
    events += [_meta(_ROLLOUTS, lane + 1, f"slot {lane}") for lane in range(run.lanes)]
    for r in run.rollouts:
        args: dict[str, Any] = {"scenario_index": r.scenario_index, "fate": r.fate}
        args["start_version"] = r.start_version
        if r.group_version is not None:
            args["group_version"] = r.group_version
        if r.step is not None:
            args.update(
                step=r.step, age_steps=r.age_steps, age_tokens=r.age_tokens, queued_s=r.queued_s
            )
        name = f"rollout {r.scenario_index}: {r.fate}"
        events.append(
            _slice(_ROLLOUTS, r.lane + 1, "rollout", name, r.start - t0, r.end - t0, args)
        )
    ages: dict[int | None, StepAges] = {s.step: s for s in run.steps}
    for band in run.train_calls:
        args = {"step": band.step, "completed": band.completed}
        if (s := ages.get(band.step)) is not None:
            args.update(groups=len(s.ages), age_steps=list(s.ages), token_age=s.token_age)
            args["queued_s"] = list(s.queued_s)
        name = f"train step {band.step}"
        events.append(
            _slice(_TRAINER, _TRAIN_TID, "train", name, band.start - t0, band.end - t0, args)
        )
    for band in run.evals:
        args = {"step": band.step, "completed": band.completed}
        name = f"eval step {band.step}"
        events.append(
            _slice(_TRAINER, _EVAL_TID, "eval", name, band.start - t0, band.end - t0, args)
        )
    for band in run.stalls:
        events.append(
            _slice(_TRAINER, _STALL_TID, "stall", "stalled", band.start - t0, band.end - t0, {})
        )
    for t, version in run.publishes:
        instant = {"ph": "i", "s": "g", "pid": _TRAINER, "tid": _TRAIN_TID, "cat": "publish"}
        events.append(
            {
                **instant,
                "name": f"policy {version} published",
                "ts": _us(t - t0),
                "args": {"version": version},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"trainer": run.trainer, "outcome": run.outcome, "log": str(run.path)},
    }


def write_trace(run: RunTimeline, path: str | Path) -> Path:
    """Write `run`'s Trace Event JSON to `path`."""
    path = Path(path)
    path.write_text(json.dumps(trace_events(run)), encoding="utf-8")
    return path
