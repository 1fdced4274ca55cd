"""Does the online autotuner settle where it should, every time? (issue 50, item 6)

The workload: exponential rollouts of mean 50 ms, 50 ms training calls,
`max_steps_off_policy=2`, batches of 8 groups, 120 steps, `autotune` in online mode, started
from 2 and from 256 workers over twenty seeds (the issue's five, and fifteen more). "Where it
should" is the smallest fixed pool whose trainer utilization (median over five seeds, from
step 10) reaches the tuner's target (0.95), found by a sweep of fixed pools. The check: every
run's final worker count within a quarter of that pool, and all forty final counts within a
quarter of their median of one another.

Everything runs in the simulator's virtual time (trio's MockClock, workload draws and trio's
scheduler seeded: `autotune_bench.run`), so every figure repeats exactly on any machine, a
loaded two-core CI runner included, and the whole check takes seconds.

    python benchmarks/autotune_settle.py           # judge the tuner against the committed pool
    python benchmarks/autotune_settle.py --sweep   # sweep every fixed pool (the full search)
    python benchmarks/autotune_settle.py --json out.json
    python benchmarks/autotune_settle.py --real-time --seeds 5   # the tuner on the wall clock

The performance gate (`perf_gate.py`) runs the check; `perf_gate.py --write-baseline`
saves its figures (with the full sweep) under `autotune_settle` in benchmarks/baseline.json.
Without `--sweep` the committed smallest pool is confirmed by its own runs and those of the
pool one smaller (utilization grows with the pool, so that pins it) instead of a sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autotune_bench as bench  # noqa: E402

from art_trio import AutotuneConfig  # noqa: E402
from art_trio.sim.workloads import PRESETS, Workload  # noqa: E402
from art_trio.testing.distributions import Constant  # noqa: E402

STEPS = 120
#: The tuner's runs: the issue's five seeds and fifteen more, so that a tuner settling right
#: only most of the time fails too (a run takes a third of a second).
SEEDS = tuple(range(20))
#: The fixed pools' runs (their utilization moves by under 0.02 from seed to seed).
SWEEP_SEEDS = (0, 1, 2, 3, 4)
STARTS = (2, 256)
#: How far a final count may be from the smallest pool, and the final counts from one another
#: (as a share of the pool, and of their median).
TOLERANCE = 0.25
#: The tuner's own target (its default: the workload's config sets none).
TARGET = AutotuneConfig().target_utilization
#: A fixed pool's utilization is measured from this step on (the first steps wait for the
#: first rollouts whatever the pool).
MEASURED_FROM_STEP = 10
SWEEP = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 20, 24, 32, 64)


DESCRIPTION = ("rollouts exp(50ms), train 50ms, batch 8, max_steps_off_policy 2, "
               f"{STEPS} steps, online autotune from {' and '.join(map(str, STARTS))} workers")


def workload(seed: int) -> Workload:
    # `workers` is the fixed pool's or the tuner's start, given per run.
    return PRESETS["plenty-off2"].with_(
        name="settle", train_time=Constant(0.05), steps=STEPS, seed=seed,
        description=DESCRIPTION,
    )


def fixed_utilization(pool: int, seeds: tuple[int, ...] = SWEEP_SEEDS) -> list[float]:
    """Trainer utilization of a fixed pool, one per seed."""
    out = []
    for seed in seeds:
        w = workload(seed)
        out.append(bench.run(w, bench.fixed_kwargs(w, pool)).window(MEASURED_FROM_STEP)[0])
    return out


def reaches(utilizations: list[float]) -> bool:
    return statistics.median(utilizations) >= TARGET


def sweep(pools: tuple[int, ...] = SWEEP) -> tuple[int | None, dict[int, list[float]]]:
    """The smallest pool reaching the target (median over the seeds), and every pool's
    utilizations up to it."""
    measured: dict[int, list[float]] = {}
    for pool in pools:
        measured[pool] = fixed_utilization(pool)
        if reaches(measured[pool]):
            return pool, measured
    return None, measured


def confirm(pool: int) -> tuple[bool, dict[int, list[float]]]:
    """Whether `pool` is still the smallest reaching the target: it does, one fewer does not."""
    measured = {p: fixed_utilization(p) for p in (pool - 1, pool) if p >= 1}
    ok = reaches(measured[pool]) and (pool == 1 or not reaches(measured[pool - 1]))
    return ok, measured


def tuned_ends(
    seeds: tuple[int, ...] = SEEDS, *, real_time: bool = False
) -> dict[int, list[int]]:
    """The tuner's final worker count per start, one per seed."""
    ends: dict[int, list[int]] = {}
    for start in STARTS:
        for seed in seeds:
            w = workload(seed)
            trace = bench.run(w, bench.tuned_kwargs(w, start), real_time=real_time)
            ends.setdefault(start, []).append(trace.final_workers)
    return ends


def judge(
    ends: dict[int, list[int]], pool: int, tolerance: float = TOLERANCE,
    seeds: tuple[int, ...] = SEEDS,
) -> list[str]:
    """Every way the final counts miss: too far from `pool`, or too far apart."""
    failures = [
        f"start {start} seed {seed}: ended at {n} workers, more than {tolerance:.0%} from "
        f"the smallest pool that reaches {TARGET:.2f} ({pool})"
        for start, counts in ends.items()
        for seed, n in zip(seeds, counts, strict=False)
        if abs(n - pool) > tolerance * pool
    ]
    every = [n for counts in ends.values() for n in counts]
    median = statistics.median(every)
    if max(every) - min(every) > tolerance * median:
        failures.append(
            f"final counts {min(every)}-{max(every)} vary by more than {tolerance:.0%} of "
            f"their median {median:g}")
    return failures


def measure(
    full_sweep: bool, committed_pool: int | None, seeds: tuple[int, ...] = SEEDS,
    real_time: bool = False,
) -> dict[str, Any]:
    """The check's figures: the smallest pool (swept, or the committed one confirmed) and
    the tuner's final counts."""
    started = time.perf_counter()
    confirmed = None
    if full_sweep or committed_pool is None:
        pool, utilizations = sweep()
    else:
        confirmed, utilizations = confirm(committed_pool)
        pool = committed_pool
    ends = tuned_ends(seeds, real_time=real_time)
    return {
        "workload": DESCRIPTION, "seeds": list(seeds), "sweep_seeds": list(SWEEP_SEEDS),
        "starts": list(STARTS),
        "target": TARGET, "tolerance": TOLERANCE, "measured_from_step": MEASURED_FROM_STEP,
        "smallest_pool": pool, "pool_confirmed": confirmed,
        "fixed_utilization": {str(p): u for p, u in utilizations.items()},
        "ends": {str(s): e for s, e in ends.items()}, "real_time": real_time,
        "real_s": time.perf_counter() - started,
    }


def failures(figures: dict[str, Any], committed_pool: int | None) -> list[str]:
    pool = figures["smallest_pool"]
    if pool is None:
        return ["no fixed pool in the sweep reaches the target: the workload changed"]
    out = []
    if figures["pool_confirmed"] is False or (
        committed_pool is not None and pool != committed_pool
    ):
        out.append(
            f"the smallest pool reaching {TARGET:.2f} is no longer {committed_pool} "
            f"(fixed pools: {figures['fixed_utilization']}): the simulator or the trainer "
            "changed; sweep again (--sweep) and rewrite the baseline")
    ends = {int(s): e for s, e in figures["ends"].items()}
    return out + judge(ends, pool, seeds=tuple(figures["seeds"]))


def report(figures: dict[str, Any]) -> str:
    ends = "; ".join(f"from {s}: {', '.join(map(str, e))}" for s, e in figures["ends"].items())
    return (f"autotune settling: smallest pool reaching {TARGET:.2f} = "
            f"{figures['smallest_pool']}; tuner's final counts {ends} "
            f"({figures['real_s']:.0f} s, "
            f"{'the tuner in real time' if figures.get('real_time') else 'virtual time'})")


def committed(baseline: dict[str, Any]) -> int | None:
    section = baseline.get("autotune_settle")
    return int(section["smallest_pool"]) if section else None


def write_baseline(path: Path, revision: str) -> dict[str, Any]:
    """Sweep, run the tuner and save the figures as `autotune_settle` in the baseline at
    `path` (its other contents kept)."""
    figures = measure(True, None) | {"art_trio_revision": revision}
    baseline = json.loads(path.read_text()) if path.exists() else {}
    baseline["autotune_settle"] = figures
    path.write_text(json.dumps(baseline, indent=1))  # as perf_gate.py writes it
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep every fixed pool")
    parser.add_argument("--baseline", type=Path,
                        default=Path(__file__).with_name("baseline.json"))
    parser.add_argument("--write-baseline", metavar="REVISION",
                        help="sweep, run and save the figures in the baseline, measured at "
                             "REVISION")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--first-seed", type=int, default=0, metavar="N",
                        help="run the tuner at seeds N..N+19 (the gate runs 0..19)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), metavar="K",
                        help=f"run the tuner at K seeds from --first-seed (default {len(SEEDS)})")
    parser.add_argument("--real-time", action="store_true",
                        help="run the tuner's runs on the wall clock (real sleeps, ~8 s a "
                             "run; the fixed pools stay in virtual time)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.write_baseline:
        figures = write_baseline(args.baseline, args.write_baseline)
        print(report(figures))
        return 1 if failures(figures, None) else 0
    pool = committed(json.loads(args.baseline.read_text()))
    seeds = tuple(range(args.first_seed, args.first_seed + args.seeds))
    figures = measure(args.sweep, pool, seeds, real_time=args.real_time)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    problems = failures(figures, None if args.sweep else pool)
    for problem in problems:
        print("  " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
