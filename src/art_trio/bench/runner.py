"""Benchmark ART's asyncio ``PipelineTrainer`` against art_trio's, on sleep-based workloads.

Each (trainer kind, workload, seed) runs in its own subprocess (``art_trio.bench.child``), so
peak RSS is per run and one run's garbage cannot slow the next. Kinds:

* ``art``: the installed ART's ``art.pipeline_trainer.PipelineTrainer`` (0.5.18 on Python
  3.11, 0.5.23 on 3.12+, each with its own API) under asyncio. Its
  ``_validate_backend_support`` is patched to a no-op so it runs without torch (the check
  imports ``art.local.backend``; it only concerns ``LocalBackend``, which is not used here).
* ``trio``: ``art_trio.PipelineTrainer`` under ``trio.run`` with asyncio rollouts (the
  bridge: what ART users' code takes); ``trio-native``: the same with anyio rollouts marked
  ``trio_native``.
* ``asyncio``: ``art_trio.PipelineTrainer`` under ``anyio.run(..., backend="asyncio")``.

All use a real ``art.TrainableModel`` with ``model.log`` stubbed to an async no-op, the
synthetic backend and rollout doubles of :mod:`art_trio.sim.workload` (real wall time), and
print one markdown table: steps/s, groups/s, trainer utilization, wasted rollouts, staleness
histogram, return latency and peak RSS per workload and kind, with art_trio/ART ratios. Then
the memory table, and the admission-knob sweep: art_trio's utilization and waste for a range
of ``max_rollouts_beyond_bound`` (and ``admission="eager"``) beside ART's single point.

Entry point: :func:`main` (``art-trio bench ...`` dispatches here;
``benchmarks/pipeline_bench.py`` too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from art_trio.bench.report import Cell, main_table, memory_table, sweep_table
from art_trio.bench.trainers import (
    ADMISSION,
    ADMISSION_EAGER,
    ART_PATCH_NOTE,
    DEFAULT_KINDS,
    KINDS,
    KNOB,
)
from art_trio.sim.measures import RunReport
from art_trio.sim.workloads import (
    MEMORY_WORKLOADS,
    OVERHEAD_WORKLOADS,
    PRESETS,
    SCHEDULING_WORKLOADS,
)

#: Knob values swept by default (0 = admit only what the staleness bound says is trainable).
DEFAULT_SWEEP_VALUES: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 64)
QUICK_SWEEP_VALUES: tuple[int, ...] = (0, 4, 16)
QUICK_WORKLOADS: tuple[str, ...] = (
    "plenty-off1",
    "on-policy",
    "tight-off1",
    "defaults",
    "overhead-b1",
)
QUICK_SWEEP_WORKLOADS: tuple[str, ...] = ("plenty-off1", "tight-off1")
QUICK_STEPS = 10
#: Quick mode shrinks the overhead/memory workloads to these sizes.
QUICK_OVERHEAD_STEPS = 500
QUICK_MEMORY_SCENARIOS = 20_000
QUICK_MEMORY_CHECKPOINT = 2_000

_WORKLOAD_GROUPS: dict[str, tuple[str, ...]] = {
    "all": SCHEDULING_WORKLOADS + OVERHEAD_WORKLOADS + MEMORY_WORKLOADS,
    "scheduling": SCHEDULING_WORKLOADS,
    "overhead": OVERHEAD_WORKLOADS,
    "memory": MEMORY_WORKLOADS,
}


@dataclass
class Job:
    """One child process: a kind, a workload (preset + overrides) and knob points to run."""

    kind: str
    workload: str
    overrides: dict[str, Any]
    points: list[dict[str, Any]]
    sweep: bool = False
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse_workloads(text: str) -> list[str]:
    names: list[str] = []
    for token in _split(text):
        for name in _WORKLOAD_GROUPS.get(token, (token,)):
            if name not in PRESETS:
                raise argparse.ArgumentTypeError(
                    f"unknown workload {name!r}; known: {', '.join(PRESETS)} "
                    f"or groups {', '.join(_WORKLOAD_GROUPS)}"
                )
            if name not in names:
                names.append(name)
    return names


def _parse_kinds(text: str) -> list[str]:
    kinds = _split(text)
    for kind in kinds:
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    return kinds


def _parse_ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _split(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse_sweep(text: str) -> list[int]:
    return [] if text.strip().lower() in {"off", "none", "no", ""} else _parse_ints(text)


def build_parser() -> argparse.ArgumentParser:
    """The ``art-trio bench`` command line."""
    parser = argparse.ArgumentParser(
        prog="art-trio bench",
        allow_abbrev=False,  # a misspelt flag is an error, not another flag
        description=(
            "Compare the installed ART's asyncio PipelineTrainer with art_trio's on sleep-based "
            "workloads (one subprocess per run). " + ART_PATCH_NOTE
        ),
    )
    parser.add_argument(
        "--workloads",
        type=_parse_workloads,
        default=None,
        help="comma list of workload names or groups (all, scheduling, overhead, memory); "
        f"presets: {', '.join(PRESETS)}; default all",
    )
    parser.add_argument(
        "--kinds",
        type=_parse_kinds,
        default=list(DEFAULT_KINDS),
        help="comma list of trainer kinds: art, trio (asyncio rollouts through the bridge: "
        "the user path), trio-native (anyio rollouts marked trio_native), asyncio, "
        "asyncio-selector (art_trio on a plain SelectorEventLoop); default "
        + ",".join(DEFAULT_KINDS),
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train steps for the scheduling workloads (default 20; overhead/memory keep "
        "their own sizes)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="num_rollout_workers for the scheduling workloads (default: each workload's "
        "own); on on-policy it sets how many rollouts race for each batch",
    )
    parser.add_argument(
        "--seeds",
        type=_parse_ints,
        default=[0],
        help="comma list of seeds; metrics are averaged over them (default 0)",
    )
    parser.add_argument(
        "--sweep",
        type=_parse_sweep,
        default=None,
        metavar="VALUES|off",
        help=f"{KNOB} values to sweep on the scheduling workloads, plus {ADMISSION}="
        f"{ADMISSION_EAGER!r}; 'off' to skip (default "
        f"{','.join(map(str, DEFAULT_SWEEP_VALUES))}; first seed only)",
    )
    parser.add_argument(
        "--sweep-kinds",
        type=_parse_kinds,
        default=["trio"],
        help="art_trio kinds to sweep (default trio)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write all results as JSON here"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="without --json, write results-<time>.json/.md here (default ./benchmarks/results "
        "if ./benchmarks exists)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smaller run (about 3 min on 2 cores): workloads {','.join(QUICK_WORKLOADS)}, "
        f"{QUICK_STEPS} steps, sweep {','.join(map(str, QUICK_SWEEP_VALUES))} on "
        f"{','.join(QUICK_SWEEP_WORKLOADS)}",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="child processes at once (default 1: runs are wall-time "
        "measurements and share 2 cores)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a child run is killed (default 600)",
    )
    return parser


def _overrides(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"seed": seed}
    if name in SCHEDULING_WORKLOADS:
        steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else None)
        if steps is not None:
            overrides["steps"] = steps
        if getattr(args, "workers", None) is not None:
            overrides["workers"] = args.workers
    elif args.quick and name in OVERHEAD_WORKLOADS:
        overrides["steps"] = QUICK_OVERHEAD_STEPS
    elif args.quick and name in MEMORY_WORKLOADS:
        overrides["scenarios"] = QUICK_MEMORY_SCENARIOS
        overrides["rss_checkpoints"] = [QUICK_MEMORY_CHECKPOINT]
    return overrides


def _art_trio_status() -> str | None:
    """None if art_trio's trainer imports, else why not (checked in a throwaway process)."""
    probe = subprocess.run(
        [sys.executable, "-c", "from art_trio import PipelineTrainer"],
        capture_output=True,
        text=True,
        env=_child_env(),
        check=False,
    )
    if probe.returncode == 0:
        return None
    lines = (probe.stderr or probe.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {probe.returncode}"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Must be set before ART (litellm) is imported; no network for the price map here.
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return env


# Children still running, so an interrupted benchmark can kill them rather than orphan them.
_live: set[subprocess.Popen[str]] = set()
_live_lock = threading.Lock()


def _kill_children() -> None:
    with _live_lock:
        for proc in _live:
            proc.kill()


def _run_job(job: Job, timeout: float) -> Job:
    with tempfile.TemporaryDirectory(prefix="art-trio-bench-job-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec = {
            "kind": job.kind,
            "workload": job.workload,
            "overrides": job.overrides,
            "points": job.points,
        }
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        started = time.monotonic()
        proc = subprocess.Popen(
            # By path, not -m: the art kind must not import the art_trio package (child.py).
            [
                sys.executable,
                str(Path(__file__).with_name("child.py")),
                str(spec_path),
                str(out_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        with _live_lock:
            _live.add(proc)
        try:
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                job.results = [
                    {"extra": p, "error": f"timed out after {timeout:.0f}s"} for p in job.points
                ]
                return job
        finally:
            with _live_lock:
                _live.discard(proc)
            job.seconds = time.monotonic() - started
        if proc.returncode == 0 and out_path.exists():
            job.results = json.loads(out_path.read_text(encoding="utf-8"))
        else:
            tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
            job.results = [
                {"extra": p, "error": f"child exit {proc.returncode}: {tail}"} for p in job.points
            ]
    return job


def _progress(job: Job) -> None:
    errors = [r for r in job.results if "error" in r]
    status = f"{len(errors)} error(s): {errors[0]['error'][:200]}" if errors else "ok"
    label = "sweep" if job.sweep else "run"
    print(
        f"  {label} {job.kind:16s} {job.workload:13s} seed={job.overrides.get('seed')} "
        f"points={len(job.points)} {job.seconds:5.1f}s {status}",
        file=sys.stderr,
        flush=True,
    )


def _cells(jobs: Sequence[Job]) -> list[Cell]:
    cells: dict[tuple[str, str, str], Cell] = {}
    for job in jobs:
        for result in job.results:
            extra = result.get("extra", {})
            key = (job.kind, job.workload, json.dumps(extra, sort_keys=True))
            cell = cells.setdefault(key, Cell(job.kind, job.workload, extra))
            if "report" in result:
                cell.reports.append(RunReport.from_dict(result["report"]))
            else:
                cell.errors.append(str(result.get("error")))
    return list(cells.values())


def _exit_on_sigterm() -> Any:
    """Make SIGTERM raise SystemExit (so children get killed); returns the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _event_loops(cells: Sequence[Cell]) -> str:
    """Which event loop each kind ran on, and a warning if ART's saw trio_asyncio."""
    loops: dict[str, set[str]] = {}
    tainted = False
    for c in cells:
        for r in c.reports:
            loops.setdefault(c.kind, set()).add(str(r.labels.get("event_loop")))
            tainted |= c.kind == "art" and bool(r.labels.get("trio_asyncio_imported"))
    if not loops:
        return ""
    text = "Event loops: " + "; ".join(
        f"{kind}: {', '.join(sorted(names))}" for kind, names in loops.items()
    )
    if tainted:
        text += " WARNING: trio_asyncio was imported in an art run (asyncio patched)."
    return text


def _load_warning(cells: Sequence[Cell]) -> str | None:
    """A warning if other work loaded the machine during the runs (wall times suffer)."""
    cpus = os.cpu_count() or 1
    loads = [
        float(r.labels.get("load1_after", 0.0))
        for c in cells
        for r in c.reports
        if r.labels.get("load1_after") is not None
    ]
    if not loads or max(loads) <= cpus:
        return None
    busy = sum(load > cpus for load in loads)
    return (
        f"WARNING: 1-min load average reached {max(loads):.1f} on {cpus} CPUs ({busy} of "
        f"{len(loads)} runs ended above {cpus}): other processes competed for the cores, so "
        "wall-time figures (rates, util) are perturbed; CPU us/group much less so. Re-run "
        "on a quiet machine for numbers to quote."
    )


def _source_revision() -> str:
    """The art_trio checkout's commit (``+dirty`` with local changes), or ``unknown``."""
    here = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _meta(args: argparse.Namespace, skipped: dict[str, str]) -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "openpipe-art": version("openpipe-art"),
        "art-trio": version("art-trio"),
        "art_trio_revision": _source_revision(),
        "trio": version("trio"),
        "anyio": version("anyio"),
        "knob": KNOB,
        "admission_keyword": ADMISSION,
        "art_patch": ART_PATCH_NOTE,
        "skipped_kinds": skipped,
        "argv": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


@dataclass
class _Plan:
    """What one `art-trio bench` invocation runs, resolved from its arguments."""

    workloads: list[str]
    kinds: list[str]
    sweep_workloads: list[str]
    #: art_trio kinds left out, and why (art_trio not importable).
    skipped: dict[str, str]
    jobs: list[Job]


def _plan(args: argparse.Namespace) -> _Plan:
    """The child runs the arguments ask for: main runs per (workload, seed, kind), then the
    admission sweep on the scheduling workloads."""
    workloads: list[str] = args.workloads or (
        list(QUICK_WORKLOADS) if args.quick else list(_WORKLOAD_GROUPS["all"])
    )
    sweep_values: list[int] = (
        args.sweep
        if args.sweep is not None
        else list(QUICK_SWEEP_VALUES if args.quick else DEFAULT_SWEEP_VALUES)
    )
    kinds, sweep_kinds, skipped = _importable_kinds(
        args.kinds, [k for k in args.sweep_kinds if k != "art"]
    )
    jobs = [
        Job(kind, name, _overrides(name, seed, args), [{}])
        for name in workloads
        for seed in args.seeds
        for kind in kinds
    ]
    sweep_workloads = [
        w
        for w in workloads
        if w in SCHEDULING_WORKLOADS
        and (not args.quick or args.workloads or w in QUICK_SWEEP_WORKLOADS)
    ]
    if sweep_values:
        points = [{KNOB: v} for v in sweep_values] + [{ADMISSION: ADMISSION_EAGER}]
        jobs += [
            Job(kind, name, _overrides(name, args.seeds[0], args), points, sweep=True)
            for name in sweep_workloads
            for kind in sweep_kinds
        ]
    return _Plan(workloads, kinds, sweep_workloads, skipped, jobs)


def _importable_kinds(
    kinds: list[str], sweep_kinds: list[str]
) -> tuple[list[str], list[str], dict[str, str]]:
    """The kinds and sweep kinds that can run: without an importable art_trio, only `art`
    (the others are returned as skipped, with the reason)."""
    skipped: dict[str, str] = {}
    if all(k == "art" for k in kinds + sweep_kinds):
        return kinds, sweep_kinds, skipped
    reason = _art_trio_status()
    if reason is None:
        return kinds, sweep_kinds, skipped
    for trio_kind in KINDS[1:]:
        if trio_kind in kinds or trio_kind in sweep_kinds:
            skipped[trio_kind] = reason
    print(
        f"art_trio.PipelineTrainer not importable, skipping art_trio kinds: {reason}",
        file=sys.stderr,
    )
    return [k for k in kinds if k == "art"], [], skipped


def _run_jobs(jobs: list[Job], args: argparse.Namespace) -> float:
    """Run every job's child (`--jobs` at a time), reporting progress; the seconds taken.
    On any way out, children still running are killed."""
    started = time.monotonic()
    # Wall-time measurements: by default one child at a time so runs do not share the cores.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs))
    previous_sigterm = _exit_on_sigterm()
    try:
        for job in pool.map(lambda j: _run_job(j, args.timeout), jobs):
            _progress(job)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_children()
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    pool.shutdown()
    return time.monotonic() - started


_KINDS_LEGEND = (
    "trio = art_trio.PipelineTrainer on trio with asyncio rollouts through the "
    "trio-asyncio bridge (the path ART users' code takes); trio-native = the same with "
    "anyio rollouts marked trio_native (no bridge); asyncio = art_trio on anyio's asyncio "
    "backend. art_trio rows show (art_trio/ART). roll-s/group = every rollout-second paid "
    "(cancelled and unfinished rollouts included) per trained group. util = time in "
    "train() over first train start to last train end; waste = rollouts started and "
    "completed before the last step began but never trained, over rollouts started "
    "before it; staleness = trained groups by (policy version trained from - "
    "initial_policy_version); return s = last train end to "
    "train() returning. "
)


def _report(
    plan: _Plan,
    seeds: int,
    elapsed: float,
    revision: str,
    main_cells: list[Cell],
    sweep_cells: list[Cell],
) -> str:
    """The Markdown report: the main table, loops, load warning, memory and sweep tables."""
    shown_kinds = [k for k in KINDS if k in plan.kinds]
    sections = [
        f"# art_trio vs ART pipeline trainer ({seeds} seed(s), {elapsed:.0f}s, "
        f"art_trio {revision})",
        f"Kinds: art = ART {metadata.version('openpipe-art')} PipelineTrainer on asyncio; "
        + _KINDS_LEGEND
        + ART_PATCH_NOTE,
        main_table(main_cells, plan.workloads, shown_kinds),
    ]
    loops = _event_loops(main_cells + sweep_cells)
    if loops:
        sections.insert(2, loops)
    warning = _load_warning(main_cells + sweep_cells)
    if warning:
        sections.insert(1, warning)
    if plan.skipped:
        sections.append("Skipped: " + "; ".join(f"{k}: {v}" for k, v in plan.skipped.items()))
    memory = [w for w in plan.workloads if w in MEMORY_WORKLOADS]
    mem = memory_table(main_cells, memory, shown_kinds)
    if mem:
        sections += ["## Memory (peak RSS as groups are trained)", mem]
    if sweep_cells:
        sections += [
            f"## Admission sweep ({KNOB}, and {ADMISSION}={ADMISSION_EAGER!r}) vs ART",
            sweep_table(sweep_cells, main_cells, plan.sweep_workloads),
        ]
    return "\n\n".join(sections) + "\n"


def _results_path(args: argparse.Namespace) -> Path | None:
    """Where the JSON goes: `--json`, else a stamped file in `--results-dir` (by default
    benchmarks/results when run from the checkout), else nowhere."""
    out: Path | None = args.json
    results_dir: Path | None = args.results_dir
    if out is None and results_dir is None and Path("benchmarks").is_dir():
        results_dir = Path("benchmarks", "results")
    if out is None and results_dir is not None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = results_dir / f"results-{stamp}.json"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the tables; write JSON. Returns a process exit code."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    plan = _plan(args)
    revision = _source_revision()
    runs = sum(len(j.points) for j in plan.jobs)
    print(
        f"art_trio {revision}: {len(plan.jobs)} child runs ({runs} trainer runs); "
        f"{ART_PATCH_NOTE}",
        file=sys.stderr,
        flush=True,
    )
    elapsed = _run_jobs(plan.jobs, args)
    main_cells = _cells([j for j in plan.jobs if not j.sweep])
    sweep_cells = _cells([j for j in plan.jobs if j.sweep])
    text = _report(plan, len(args.seeds), elapsed, revision, main_cells, sweep_cells)
    print(text)
    payload = {
        "meta": _meta(args, plan.skipped),
        "workloads": {w: PRESETS[w].to_dict() for w in plan.workloads},
        "runs": [c.to_dict() for c in main_cells],
        "sweep": [c.to_dict() for c in sweep_cells],
    }
    out = _results_path(args)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        print(f"results: {out} (+ .md)", file=sys.stderr)
    return 1 if _failed(main_cells + sweep_cells) else 0


def _failed(cells: list[Cell]) -> bool:
    """Whether any run failed; a knob the trainer does not (yet) take is reported in the
    table, not a failure."""
    return any(not e.startswith("unsupported:") for c in cells for e in c.errors)


if __name__ == "__main__":
    sys.exit(main())
