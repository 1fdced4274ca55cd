"""The online autotuner under eager admission on a busy host, in the simulator's virtual time.

Issue 25: with `admission="eager"` the tuner once ran 32 workers up to 374-824 while
utilization stayed at 0.25-0.49 and most rollouts ended stale. This runs one tuned run per
workload (the simulator's presets, `--rollout-cpu` seconds of the trainer's CPU per rollout so
that extra workers cost something) and prints the worker counts it went through, utilization
over the last 60 steps and rollout-seconds per trained group. Usage:

    LITELLM_LOCAL_MODEL_COST_MAP=True python benchmarks/autotune_eager.py \\
        --workloads on-policy,plenty-off1 --start 32 --steps 200 --rollout-cpu 0.003
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autotune_bench as bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="on-policy,plenty-off1")
    parser.add_argument("--start", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--admission", default="eager")
    parser.add_argument("--rollout-cpu", type=float, default=0.003)
    args = parser.parse_args(argv)
    for name in args.workloads.split(","):
        w = bench.workload_for(name, args.steps).with_(rollout_cpu_s=args.rollout_cpu)
        kwargs = bench.tuned_kwargs(w, args.start)
        kwargs["admission"] = args.admission
        started = time.perf_counter()
        trace = bench.run(w, kwargs)
        last = trace.snapshots[-1]
        util, cost = trace.window(max(0, args.steps - 60))
        print(f"{name}: workers {[args.start] + [n for _, n, _ in trace.changes]}, "
              f"utilization (last 60 steps) {util:.3f}, {cost * 1000:.1f} ms of rollouts per "
              f"trained group, stale {last.stale} of {last.taken} taken "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        for step, n, reason in trace.changes:
            print(f"    step {step}: -> {n}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
