"""The overhead rows beside an older commit's, in one sitting: is a change in the ratio the code's?

    python benchmarks/overhead_against.py 93a6a4e [--workloads overhead-b32,overhead-b1] [--seeds 5]

The README's overhead rows are art_trio's groups/s over ART's in one run, and ART's own
figure moves a tenth or more from one sitting to the next on this 2-core machine: a ratio
measured in another hour is not a baseline for this one. This puts a worktree of the older
commit beside the checkout and runs, for each seed in turn, ART's trainer, then each path of
the older commit and of this checkout, each in a fresh process with its own tree's benchmark
child (`art_trio/bench/child.py`, so the older commit is measured by its own harness): the
same seed, workload and machine state for every arm. It prints each arm's median groups/s and
CPU microseconds per group, and its ratio to ART's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
#: The paths measured: asyncio rollouts under `trio.run` (bridged) and `anyio.run` on asyncio.
PATHS = ("trio", "asyncio")


def run_child(label: str, tree: Path, kind: str, workload: str, seed: int) -> dict[str, float]:
    """One run of `workload` at `seed` by `tree`'s benchmark child, in a fresh process; the arm
    is named `label` if it fails."""
    spec = {"kind": kind, "workload": workload, "overrides": {"seed": seed}, "points": [{}]}
    with tempfile.TemporaryDirectory() as scratch:
        spec_path, out_path = Path(scratch, "spec.json"), Path(scratch, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as the bench runner's children
        child = tree / "src" / "art_trio" / "bench" / "child.py"
        done = subprocess.run(
            [sys.executable, str(child), str(spec_path), str(out_path)],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0 or not out_path.exists():
            sys.exit(f"{label}, {workload} seed {seed} failed:\n{done.stderr[-2000:]}")
        result = json.loads(out_path.read_text())[0]
    if "error" in result:
        sys.exit(f"{label}, {workload} seed {seed}: {result['error']}")
    report = result.get("report", result)
    return {"groups_per_s": report["groups_per_s"], "cpu_us": report["cpu_us_per_group"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="the older commit (anything `git worktree add` takes)")
    parser.add_argument("--workloads", default="overhead-b32,overhead-b1")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1, each arm once per seed")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        older = Path(scratch, "older")
        added = subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", str(older), args.revision],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if added.returncode != 0:
            sys.exit(f"no worktree of {args.revision!r}: {added.stderr.strip()}")
        try:
            arms = [("ART", HERE, "art")] + [
                (f"{name} {path}", tree, path)
                for path in PATHS
                for name, tree in ((args.revision, older), ("this checkout", HERE))
            ]
            for workload in args.workloads.split(","):
                figures: dict[str, list[dict[str, float]]] = defaultdict(list)
                for seed in range(args.seeds):
                    for label, tree, kind in arms:
                        figures[label].append(run_child(label, tree, kind, workload, seed))
                report(workload, args.seeds, figures)
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(older)],
                check=False, capture_output=True,
            )  # fmt: skip


def report(workload: str, seeds: int, figures: dict[str, list[dict[str, float]]]) -> None:
    def median(label: str, key: str) -> float:
        return statistics.median(run[key] for run in figures[label])

    art = median("ART", "groups_per_s")
    print(f"\n{workload}, median of {seeds} seeds, arms interleaved per seed")
    print("| arm | groups/s | x ART's | CPU us per group |")
    print("|---|---|---|---|")
    for label in figures:
        groups = median(label, "groups_per_s")
        print(f"| {label} | {groups:,.0f} | {groups / art:.2f}x | {median(label, 'cpu_us'):.0f} |")


if __name__ == "__main__":
    main()
