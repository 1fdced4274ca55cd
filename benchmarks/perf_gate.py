"""The performance gate: art_trio's figures held against ART's in the same run and against
art_trio's own committed baseline (benchmarks/baseline.json).

    python benchmarks/perf_gate.py                    # run the gate's workloads, then check
    python benchmarks/perf_gate.py --results R.json   # check a run already made
    python benchmarks/perf_gate.py --write-baseline   # run, and make that run the baseline

The run is `art-trio bench` on the README's workloads (ART's asyncio trainer and art_trio's,
each in a subprocess of its own, one after the other), about six minutes on two
cores. A noisy machine moves both trainers alike, so every figure is judged as art_trio's against
ART's in the same run (a difference for utilization, a ratio for costs and rates), and that
against the same comparison in the baseline; each workload's figure is the median over its
seeds. The tolerances are set from repeated runs on a two-core machine: wide enough that
ordinary noise passes, narrow enough that a fifth of utilization lost (what one admission
rule cost the on-policy workload) fails by a margin.

Then the autotuner's settling (`autotune_settle.py`, issue 50): from 2 and from 256 workers over
twenty seeds, its final worker counts within a quarter of the smallest fixed pool that reaches
its utilization target and of one another. That check runs in the simulator's virtual time
(seeded; the same figures on any machine, in seconds) and holds against the pool committed
under `autotune_settle` in the baseline, confirmed by a run of it and of one pool fewer.

Exit code: 0 when every figure holds, 1 when one does not (each failure printed with both
runs' figures), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASELINE = Path(__file__).with_name("baseline.json")

#: The README's workloads: the scheduling ones and the scheduler's overhead at both batch
#: sizes. The baseline run also has `trio-native` and `asyncio`, for the README's table.
SCHEDULING = ("on-policy", "plenty-off1", "heavy-tail", "tight-off1", "defaults")
OVERHEAD = ("overhead-b32", "overhead-b1")
GATE_KINDS = ("art", "trio", "asyncio")
BASELINE_KINDS = ("art", "trio", "trio-native", "asyncio")
#: Seeds per workload (the figure is their median): the on-policy race, the tight workload
#: (art_trio's utilization there moved 0.870-0.896 over twelve runs of one seed, against a
#: slack of 0.03) and the overhead at batch 1 move most from run to run.
SEEDS = {"on-policy": (0, 1, 2), "tight-off1": (0, 1, 2), "overhead-b1": (0, 1, 2)}
DEFAULT_SEEDS = (0,)

Figures = dict[str, dict[str, dict[str, float]]]  # workload -> kind -> metric -> median


@dataclass(frozen=True)
class Rule:
    """One figure of one art_trio kind, judged against ART's in the same run."""

    metric: str
    workloads: tuple[str, ...]
    #: How art_trio's figure compares with ART's: "difference" (art_trio - ART) or "ratio".
    compare: str
    #: Which way is better: +1 higher, -1 lower.
    better: int
    #: The comparison may be this much worse than the baseline's (absolute, in its own unit).
    slack: float
    #: ... and, where set, never worse than this against ART (the README's promise).
    bound: float | None = None
    #: The slack is a share of the baseline's comparison, not an absolute amount.
    relative: bool = False

    def value(self, ours: float, art: float) -> float | None:
        if self.compare == "difference":
            return ours - art
        return ours / art if art > 0 else None

    def fails(self, now: float, baseline: float | None) -> str | None:
        if self.bound is not None and (now - self.bound) * self.better < 0:
            return f"past the bound {self.bound:+.3f}"
        if baseline is None:
            return None
        slack = self.slack * abs(baseline) if self.relative else self.slack
        if (now - baseline) * self.better < -slack:
            return f"worse than the baseline's {baseline:+.3f} by more than {slack:.3f}"
        return None


RULES = (
    # Trainer utilization: never 0.03 below ART's in the same run, nor 0.03 below the
    # baseline's difference.
    Rule("utilization", SCHEDULING, "difference", +1, slack=0.03, bound=-0.03),
    # What inference costs per trained group, and how many rollouts are thrown away.
    Rule("rollout_s_per_group", SCHEDULING, "ratio", -1, slack=0.08, bound=1.05),
    Rule("waste", SCHEDULING, "difference", -1, slack=0.04),
    # The scheduler's own cost: groups per second with rollouts and training that take no
    # time. Noisier than the rest (CPU against CPU: single runs at batch 1 moved 1.0x-1.5x
    # ART's on a loaded machine), so up to 30% of the baseline's ratio may go.
    Rule("groups_per_s", OVERHEAD, "ratio", +1, slack=0.3, relative=True),
)


def medians(results: dict[str, Any]) -> Figures:
    """Each (workload, kind)'s figures, the median over its seeds."""
    figures: Figures = {}
    for run in results["runs"]:
        if run.get("extra") or not run["reports"]:
            continue  # sweep points, failed runs
        metrics = {
            name: statistics.median(r[name] for r in run["reports"])
            for name in ("utilization", "rollout_s_per_group", "waste", "groups_per_s")
        }
        figures.setdefault(run["workload"], {})[run["kind"]] = metrics
    return figures


def check(current: Figures, baseline: Figures) -> list[str]:
    """Every figure that does not hold, said with both runs' figures."""
    failures = [
        f"{workload}: {kind} did not run"
        for workload in (*SCHEDULING, *OVERHEAD)
        for kind in GATE_KINDS
        if kind not in current.get(workload, {})
    ]
    for rule in RULES:
        for workload in rule.workloads:
            now_run, base_run = current.get(workload, {}), baseline.get(workload, {})
            for kind in GATE_KINDS[1:]:
                if kind not in now_run or "art" not in now_run:
                    continue
                now = rule.value(now_run[kind][rule.metric], now_run["art"][rule.metric])
                base = (
                    rule.value(base_run[kind][rule.metric], base_run["art"][rule.metric])
                    if kind in base_run and "art" in base_run
                    else None
                )
                if now is None:
                    continue
                why = rule.fails(now, base)
                if why:
                    failures.append(
                        f"{workload} {kind} {rule.metric}: {now_run[kind][rule.metric]:.4g} "
                        f"against ART's {now_run['art'][rule.metric]:.4g} "
                        f"({rule.compare} {now:+.3f}), {why}"
                    )
    return failures


def _autotune_settle() -> Any:
    # Imported when used: it imports art_trio and ART, which the judgement of a results
    # file (and the README's tables, built from this module) does without.
    sys.path.insert(0, str(Path(__file__).parent))
    import autotune_settle

    return autotune_settle


def settling(baseline: dict[str, Any]) -> list[str]:
    """The autotuner's settling check, in virtual time, against the baseline's pool."""
    autotune_settle = _autotune_settle()
    pool = autotune_settle.committed(baseline)
    if pool is None:
        return ["autotune settling: the baseline has no `autotune_settle` section "
                "(python benchmarks/autotune_settle.py --write-baseline REVISION)"]
    figures = autotune_settle.measure(False, pool)
    print(autotune_settle.report(figures))
    return [f"autotune settling: {f}" for f in autotune_settle.failures(figures, pool)]


def run_bench(kinds: Sequence[str], out: Path) -> dict[str, Any]:
    """Run the gate's workloads with `art-trio bench`; its JSON results."""
    from art_trio.bench.runner import main as bench

    parts = []
    groups = dict.fromkeys(SEEDS.get(w, DEFAULT_SEEDS) for w in (*SCHEDULING, *OVERHEAD))
    with tempfile.TemporaryDirectory() as tmp:
        for seeds in groups:
            workloads = [
                w for w in (*SCHEDULING, *OVERHEAD) if SEEDS.get(w, DEFAULT_SEEDS) == seeds
            ]
            path = Path(tmp) / f"part{len(parts)}.json"
            code = bench(
                [
                    "--workloads", ",".join(workloads),
                    "--kinds", ",".join(kinds),
                    "--seeds", ",".join(map(str, seeds)),
                    "--sweep", "off",
                    "--json", str(path),
                ]
            )  # fmt: skip
            if code:
                raise SystemExit(f"perf gate: the benchmark failed (exit {code}); see above")
            parts.append(json.loads(path.read_text()))
    merged = parts[0]
    for part in parts[1:]:
        merged["runs"] += part["runs"]
        merged["workloads"].update(part["workloads"])
    out.write_text(json.dumps(merged, indent=1))
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="check this bench JSON instead of running")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument(
        "--write-baseline",
        action="store_true",
        help="run with every kind the README shows and save the run as the baseline",
    )
    args = parser.parse_args(argv)
    if args.write_baseline:
        written = run_bench(BASELINE_KINDS, args.baseline)
        autotune_settle = _autotune_settle()
        settle = autotune_settle.write_baseline(
            args.baseline, written["meta"].get("art_trio_revision", "?"))
        print(autotune_settle.report(settle))
        print(f"perf gate: baseline written to {args.baseline}")
        return 0
    try:
        baseline = json.loads(args.baseline.read_text())
    except (OSError, ValueError) as exc:
        print(f"perf gate: cannot read the baseline {args.baseline}: {exc}", file=sys.stderr)
        return 2
    if args.results is not None:
        try:
            results = json.loads(args.results.read_text())
        except (OSError, ValueError) as exc:
            print(f"perf gate: cannot read {args.results}: {exc}", file=sys.stderr)
            return 2
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_bench(GATE_KINDS, Path(tmp) / "gate.json")
    failures = check(medians(results), medians(baseline))
    failures += settling(baseline)
    revision = baseline["meta"].get("art_trio_revision", "?")
    if failures:
        print(f"perf gate: {len(failures)} figure(s) fail against ART and baseline {revision}:")
        for failure in failures:
            print("  " + failure)
        return 1
    print(f"perf gate: every figure holds against ART's and baseline {revision}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
