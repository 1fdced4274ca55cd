"""The online autotuner against fixed settings, in the simulator's virtual time.

For each workload (the benchmark's scheduling workloads plus `contention` and
`latency-doubles`, run longer than the benchmark runs them so a search has room), it runs:

- the tuned trainer (`autotune=AutotuneConfig(mode="online", ...)`) starting from 4 and from
  256 workers, recording `trainer.statistics()` after every step (public seams only);
- fixed worker counts (a sweep grid), each recorded the same way.

Per tuned run: the step of its last worker change ("settled"), then over the steps after it
trainer utilization and rollout-seconds per trained group; the same window of steps is
measured in every fixed run, so "cheapest fixed" (fewest workers with utilization >= 0.95
over that window, then fewest rollout-seconds per group) and "start left alone" compare like
with like. Usage:

    LITELLM_LOCAL_MODEL_COST_MAP=True python benchmarks/autotune_bench.py [--steps 300]
        [--workloads plenty-off1,contention] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import trio  # noqa: E402
import trio.testing  # noqa: E402

from art_trio import (  # noqa: E402
    AutotuneConfig,
    PipelineTrainer,
    Resized,
    RunEvent,
    RunStatistics,
    StepTrained,
    trainable_model,
    trio_native,
)
from art_trio.sim.doubles import SyntheticBackend, make_rollout_fn  # noqa: E402
from art_trio.sim.inference import LatencyShift  # noqa: E402
from art_trio.sim.recorder import Recorder  # noqa: E402
from art_trio.sim.workloads import PRESETS, SCHEDULING_WORKLOADS, Workload, scenarios  # noqa: E402

WORKLOADS = (*SCHEDULING_WORKLOADS, "contention", "latency-doubles")
GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128, 256)
TARGET = 0.95
STARTS = (4, 256)
MIN_AFTER = 60


@dataclass
class Trace:
    """One run: statistics after every step, and the steps at which the size changed."""

    snapshots: list[RunStatistics] = field(default_factory=list)
    changes: list[tuple[int, int, str]] = field(default_factory=list)
    real_s: float = 0.0

    def window(self, start_step: int) -> tuple[float, float]:
        """Utilization and rollout-seconds per trained group from `start_step` to the end."""
        if not self.snapshots:
            return math.nan, math.nan
        first = next((s for s in self.snapshots if s.steps >= start_step), self.snapshots[-1])
        last = self.snapshots[-1]
        wall = last.since_first_step_s - first.since_first_step_s
        trained = last.trained - first.trained
        util = (last.train_s - first.train_s) / wall if wall > 0 else math.nan
        cost = (last.rollout_s_spent - first.rollout_s_spent) / trained if trained else math.nan
        return util, cost

    @property
    def settled_step(self) -> int:
        return self.changes[-1][0] if self.changes else 0

    @property
    def final_workers(self) -> int:
        return self.snapshots[-1].num_rollout_workers if self.snapshots else 0


async def _noop_log(*args: Any, **kwargs: Any) -> None:
    return None


def workload_for(name: str, steps: int) -> Workload:
    w = PRESETS[name].with_(steps=steps)
    if w.latency_shift is not None:
        shift = LatencyShift(after_steps=steps // 2, factor=w.latency_shift.factor)
        w = w.with_(latency_shift=shift)
    return w


async def _drive(w: Workload, base_path: str, trainer_kwargs: dict[str, Any]) -> Trace:
    recorder = Recorder(detailed=False)
    model: Any = trainable_model(name="at", project="autotune-bench", base_model="sim",
                                 base_path=base_path)
    backend = SyntheticBackend(w.train_time, recorder, seed=w.seed)
    await model.register(backend)
    object.__setattr__(model, "log", _noop_log)
    rollout_fn = trio_native(make_rollout_fn(w.with_(trajectories_per_group=2), recorder))
    trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
        model, backend, rollout_fn, scenarios(None), None, None,
        max_steps_off_policy=w.max_steps_off_policy,
        limit_mean_steps_off_policy=w.limit_mean_steps_off_policy,
        max_steps=w.steps, log_interval_seconds=1e12, resume=False, **trainer_kwargs,
    )
    trace = Trace()

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained):
            trace.snapshots.append(trainer.statistics())
        elif isinstance(event, Resized):
            trace.changes.append((trainer.statistics().steps, event.num_rollout_workers,
                                  event.reason))

    trainer.add_observer(observe)
    await trainer.train(handle_signals=False)
    return trace


def run(w: Workload, trainer_kwargs: dict[str, Any], *, real_time: bool = False) -> Trace:
    """One run in virtual time (trio's MockClock), or with `real_time` on the wall clock
    (real sleeps: the trainer's own per-step time shows, and runs do not repeat exactly)."""
    started = time.perf_counter()
    # trio runs each batch of ready tasks in random order (reversed half the time, from an
    # unseeded generator: trio._core._run._r), so two virtual-time runs of one seeded workload
    # can take different decision paths. Seeding it (as trio's Hypothesis plugin does) makes
    # every row of this benchmark repeatable.
    trio._core._run._r.seed(w.seed)
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            clock = None if real_time else trio.testing.MockClock(autojump_threshold=0)
            trace = trio.run(functools.partial(_drive, w, tmp, trainer_kwargs), clock=clock)
    trace.real_s = time.perf_counter() - started
    return trace


def tuned_kwargs(w: Workload, start: int) -> dict[str, Any]:
    return {"autotune": AutotuneConfig(
        mode="online", initial_model_calls_per_inference_gpu=start,
        initial_min_groups_per_packed_sequence=w.min_batch,
        initial_max_groups_per_packed_sequence=w.max_batch,
    )}


def fixed_kwargs(w: Workload, workers: int) -> dict[str, Any]:
    return {"num_rollout_workers": workers, "min_batch_size": w.min_batch,
            "max_batch_size": w.max_batch}


def evaluate(name: str, steps: int, grid: tuple[int, ...]) -> list[dict[str, Any]]:
    w = workload_for(name, steps)
    fixed = {n: run(w, fixed_kwargs(w, n)) for n in sorted(set(grid) | set(STARTS))}
    rows = []
    for start in STARTS:
        tuned = run(w, tuned_kwargs(w, start))
        settled = tuned.settled_step
        # Measured from the last change, but over at least the last MIN_AFTER steps (a run
        # whose last change came at its very end is measured over its final steps).
        since = min(settled, steps - MIN_AFTER)
        util, cost = tuned.window(since)
        measured = {n: t.window(since) for n, t in fixed.items()}
        eligible = [n for n, (u, c) in measured.items() if u >= TARGET and not math.isnan(c)]
        best = min(eligible, key=lambda n: (n, measured[n][1])) if eligible else None
        best_cost = measured[best][1] if best is not None else math.nan
        alone_util, alone_cost = measured[start]
        rows.append({
            "workload": name, "start": start, "settled_step": settled, "steps": steps,
            "measured_from_step": since,
            "final_workers": tuned.final_workers, "changes": len(tuned.changes),
            "utilization": util, "rollout_s_per_group": cost,
            "cheapest_fixed": best, "cheapest_utilization": (
                measured[best][0] if best is not None else math.nan),
            "cheapest_rollout_s_per_group": best_cost,
            "cost_vs_cheapest": cost / best_cost if best is not None else math.nan,
            "alone_utilization": alone_util, "alone_rollout_s_per_group": alone_cost,
            "path": [n for _, n, _ in tuned.changes],
            "real_s": tuned.real_s,
        })
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _line(r: dict[str, Any]) -> str:
    best = r["cheapest_fixed"]
    return (
        f"| {r['workload']} | {r['start']} | {r['settled_step']} | {r['final_workers']} | "
        f"{r['utilization']:.3f} | {r['rollout_s_per_group'] * 1000:.1f} ms | "
        + (f"{best} ({r['cheapest_utilization']:.3f}, "
           f"{r['cheapest_rollout_s_per_group'] * 1000:.1f} ms) | {r['cost_vs_cheapest']:.2f} | "
           if best is not None else "none reaches 0.95 | - | ")
        + f"{r['alone_utilization']:.3f}, {r['alone_rollout_s_per_group'] * 1000:.1f} ms |"
    )


HEADER = (
    "| workload | start | settled at step | workers then | utilization after | "
    "roll-s/group after | cheapest fixed (util, roll-s/group) | cost vs cheapest | "
    "start left alone (util, roll-s/group) |\n"
    "|---|--:|--:|--:|--:|--:|---|--:|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--grid", default=",".join(map(str, GRID)))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split(","))
    print(HEADER, file=sys.stderr)
    rows = []
    for name in args.workloads.split(","):
        rows.extend(evaluate(name, args.steps, grid))
    print(HEADER)
    for r in rows:
        print(_line(r))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
