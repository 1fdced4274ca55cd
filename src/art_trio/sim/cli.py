"""``art-trio simulate`` / ``python -m art_trio.sim``: plan a run in virtual time.

Give the workload as distributions and the trainer settings to try; the real
``PipelineTrainer`` runs against a synthetic backend under trio's ``MockClock``, so hours of
training take seconds. Prints a table (``--json`` for machines). With ``--sweep`` it runs
every combination of the swept settings and names the cheapest one that keeps the trainer
busy; ``--plot`` draws utilization and waste against the swept values.

Examples::

    art-trio simulate --rollout-latency exp:30 --train-time 60 --workers 32 --steps 500
    art-trio simulate --rollout-latency lognormal:30:1.5 --train-time 60 --min-batch-size 8 \\
        --max-batch-size 8 --sweep num_rollout_workers=8,16,32,64 max_steps_off_policy=0,1,2 \\
        --plot sweep.png
    # an inference server that serves 16 rollouts at full speed and slows down beyond that,
    # and rollouts that take twice as long from step 250 on
    art-trio simulate --rollout-latency exp:30 --train-time 60 --inference-capacity 16 \\
        --latency-shift 250:2 --sweep num_rollout_workers=8,16,32,64
    # the planned run as a picture (as `art-trio timeline` draws a recorded one)
    art-trio simulate --rollout-latency exp:30 --train-time 60 --workers 16 --steps 20 \
        --timeline plan.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from art_trio import ArtTrioError
from art_trio.cli import int_at_least, number_in
from art_trio.sim.inference import LatencyShift
from art_trio.sim.simulate import (
    DEFAULT_TARGET,
    SimReport,
    SimSpec,
    SweepResult,
    check_settings,
    combinations,
    parse_value,
    simulate,
    sweep,
    trainer_parameter_names,
)
from art_trio.testing.distributions import parse_distribution, parse_seconds
from art_trio.timeline.recorder import run_errors

__all__ = ["DEFAULT_STEPS", "build_parser", "main"]

#: Train steps simulated unless --steps or --scenarios says otherwise.
DEFAULT_STEPS = 200

# The settings that decide throughput and waste get their own flags (dest: trainer kwarg).
_SETTING_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--workers", "num_rollout_workers", int, "rollout workers (num_rollout_workers)"),
    ("--min-batch-size", "min_batch_size", int, "groups a step waits for"),
    ("--max-batch-size", "max_batch_size", int, "most groups in one step"),
    ("--max-steps-off-policy", "max_steps_off_policy", int, "staleness bound"),
    ("--admission", "admission", str, '"staleness_aware" or "eager"'),
)


def _distribution(text: str) -> Any:
    try:
        return parse_distribution(text)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _seconds(text: str) -> float:
    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _latency_shift(text: str) -> LatencyShift:
    steps, sep, factor = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return LatencyShift(after_steps=int(steps), factor=float(factor))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected STEP:FACTOR (e.g. 100:2), got {text!r}"
        ) from exc


def _assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="art-trio simulate",
        allow_abbrev=False,  # a misspelt flag is an error, not another flag
        description=(
            "Run art_trio's PipelineTrainer in virtual time against a synthetic workload and "
            "report trainer utilization, waste, staleness and queue depth. Durations are "
            "seconds (or 500ms, 2m, 1.5h). Distributions: 30 | const:30 | exp:30 | "
            "lognormal:MEAN:SIGMA | file:PATH (one duration per line or a JSON list)."
        ),
    )
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--rollout-latency",
        type=_distribution,
        required=True,
        metavar="DIST",
        help="time one rollout (one group) takes",
    )
    w.add_argument(
        "--train-time",
        type=_distribution,
        required=True,
        metavar="DIST",
        help="time one backend.train step takes",
    )
    w.add_argument(
        "--eval-time",
        type=_distribution,
        default=None,
        metavar="DIST",
        help="time one eval takes (default: no eval_fn)",
    )
    w.add_argument(
        "--zero-variance",
        type=number_in(0, 1),
        default=0.0,
        metavar="P",
        help="probability that a group has zero reward variance (default 0)",
    )
    w.add_argument(
        "--failure-rate",
        type=number_in(0, 1),
        default=0.0,
        metavar="P",
        help="probability that a rollout raises (default 0)",
    )
    w.add_argument(
        "--steps",
        type=int_at_least(1),
        default=None,
        help=f"train steps to simulate, the trainer's max_steps (default {DEFAULT_STEPS}, "
        "or until the scenarios run out if --scenarios is given)",
    )
    w.add_argument(
        "--scenarios",
        type=int_at_least(1),
        default=None, help="size of the scenario source (default: endless)"
    )
    w.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    w.add_argument(
        "--inference-capacity",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="rollouts the inference server serves at full speed; with more in flight they "
        "share it (processor sharing: each runs at N/in-flight speed, so the rollout latency "
        "grows with the number in flight). Default: unlimited",
    )
    w.add_argument(
        "--latency-shift",
        type=_latency_shift,
        default=None,
        metavar="STEP:FACTOR",
        help="rollouts started after STEP train steps take FACTOR x their drawn latency "
        "(e.g. 100:2: latency doubles from step 100 on)",
    )
    w.add_argument(
        "--rollout-cpu",
        type=_seconds,
        default=0.0,
        metavar="DURATION",
        help="CPU the trainer's process spends per rollout (starting it, finishing or "
        "cancelling it), served one at a time on one core; 0 (default) makes it free, as "
        "virtual time does. 'art-trio bench' measures it (CPU per trained group); e.g. 40us",
    )

    t = parser.add_argument_group("trainer settings (unset: PipelineTrainer's defaults)")
    for flag, dest, kind, text in _SETTING_FLAGS:
        t.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    t.add_argument(
        "--set",
        dest="settings",
        type=_assignment,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other PipelineTrainer keyword argument (repeatable), e.g. "
        "--set max_rollouts_beyond_bound=4",
    )

    s = parser.add_argument_group("sweep")
    s.add_argument(
        "--sweep",
        type=_assignment,
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=V1,V2",
        help="simulate every combination of these trainer settings, e.g. "
        "--sweep num_rollout_workers=8,16,32,64 max_steps_off_policy=0,1,2",
    )
    s.add_argument(
        "--target",
        type=number_in(0, 1, low_open=True),
        default=DEFAULT_TARGET,
        help=f"trainer utilization the cheapest setting must keep (default {DEFAULT_TARGET})",
    )
    s.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw utilization and waste against the swept values",
    )

    o = parser.add_argument_group("output")
    o.add_argument(
        "--timeline",
        default=None,
        metavar="FILE.png",
        help="draw the run as `art-trio timeline` draws a real one: a lane per worker slot, "
        "rollouts by fate, training calls and evals, in virtual seconds (one run, no --sweep)",
    )
    o.add_argument(
        "--timeline-log",
        default=None,
        metavar="FILE.jsonl",
        help="keep the run's event log here (for `art-trio timeline FILE.jsonl --trace ...`)",
    )
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    o.add_argument(
        "--real-time",
        action="store_true",
        help="run against the wall clock instead of virtual time (checks the "
        "simulator; takes as long as the workload says)",
    )
    return parser


def _spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SimSpec:
    known = set(trainer_parameter_names())
    trainer: dict[str, Any] = {}
    for _flag, dest, _kind, _text in _SETTING_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            trainer[dest] = value
    for name, value in args.settings:
        if name not in known:
            parser.error(f"--set {name}: not a PipelineTrainer parameter")
        trainer[name] = parse_value(value)
    try:
        return SimSpec(
            rollout_latency=args.rollout_latency,
            train_time=args.train_time,
            eval_time=args.eval_time,
            zero_variance_prob=args.zero_variance,
            failure_prob=args.failure_rate,
            steps=args.steps if args.steps is not None or args.scenarios else DEFAULT_STEPS,
            scenarios=args.scenarios,
            seed=args.seed,
            trainer=trainer,
            inference_capacity=args.inference_capacity,
            latency_shift=args.latency_shift,
            rollout_cpu_s=args.rollout_cpu,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _grid(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, list[Any]]:
    known = set(trainer_parameter_names())
    grid: dict[str, list[Any]] = {}
    for name, values in args.sweep:
        if name not in known or name == "max_steps":
            parser.error(f"--sweep {name}: not a PipelineTrainer parameter a sweep can vary")
        parsed = [parse_value(v) for v in values.split(",") if v.strip()]
        if not parsed:
            parser.error(f"--sweep {name}: no values")
        grid[name] = parsed
    return grid


def _draw_timeline(log: str | None, png: str) -> str:
    from art_trio.timeline import draw, load_timeline

    assert log is not None
    draw(load_timeline(log, require_steps=False), png, title="simulated run (virtual seconds)")
    return f"Timeline: {png}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``art-trio simulate ARGS`` and ``python -m art_trio.sim ARGS``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = _spec(args, parser)
    grid = _grid(args, parser)
    _check_flags_against_sweep(args, grid, parser)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    runs = len(list(combinations(grid))) if grid else 1

    # Check every combination before the first run, so a typo fails in milliseconds.
    error = _first_settings_error(spec, grid)
    if error is not None:
        print(f"art-trio simulate: error: {error}", file=sys.stderr)
        return 2

    total = None if spec.steps is None else runs * spec.steps
    try:
        with tqdm(
            total=total,
            unit="step",
            file=sys.stderr,
            disable=not show_progress,
            dynamic_ncols=True,
            desc="simulating",
        ) as bar:
            if not grid:
                report, drawn = _simulate_one(spec, args, bar)
                _print_one(spec, report, drawn, as_json=args.json)
                return 0
            result = _run_sweep(spec, grid, args, bar, runs)
    except (ArtTrioError, ExceptionGroup) as failed:
        # The simulated trainer failed as a real one would (every rollout raised, say): that
        # is the simulation's answer, said in a line, not a crash of the command.
        errors = run_errors(failed)
        if not errors or not all(isinstance(error, ArtTrioError) for error in errors):
            raise
        said = "; ".join(str(error) for error in errors)
        print(f"art-trio simulate: the simulated run failed: {said}", file=sys.stderr)
        return 1
    _print_sweep(spec, result, args.plot, as_json=args.json)
    return 0


def _check_flags_against_sweep(
    args: argparse.Namespace, grid: dict[str, list[Any]], parser: argparse.ArgumentParser
) -> None:
    """--plot draws a sweep; --real-time and the timeline flags are for one run."""
    if args.plot and not grid:
        parser.error("--plot needs --sweep")
    if args.real_time and grid:
        parser.error("--real-time runs one simulation; drop --sweep")
    if (args.timeline or args.timeline_log) and grid:
        parser.error("--timeline draws one simulation; drop --sweep")


def _first_settings_error(
    spec: SimSpec, grid: dict[str, list[Any]]
) -> ValueError | TypeError | None:
    """The error of the first combination of settings the trainer would refuse, if any."""
    try:
        for combo in combinations(grid) if grid else [{}]:
            check_settings(spec.with_trainer(**combo))
    except (ValueError, TypeError) as exc:
        return exc
    return None


def _simulate_one(
    spec: SimSpec, args: argparse.Namespace, bar: tqdm[Any]
) -> tuple[SimReport, str | None]:
    """One run, and where its timeline was drawn (None: not asked for)."""
    with tempfile.TemporaryDirectory(prefix="art-trio-timeline-") as tmp:
        # Drawing needs the event log: kept where asked, else in a directory that goes away.
        log = args.timeline_log or (None if args.timeline is None else str(Path(tmp) / "run.jsonl"))
        report = simulate(
            spec, on_step=lambda: bar.update(1), real_time=args.real_time, timeline=log
        )
        bar.close()
        drawn = None if args.timeline is None else _draw_timeline(log, args.timeline)
    return report, drawn


def _print_one(spec: SimSpec, report: SimReport, drawn: str | None, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from art_trio.sim.report import run_table

        print(f"Workload: {spec.describe()}")
        print(run_table(report))
    if drawn is not None:
        # Where the picture is, kept off stdout when stdout is JSON.
        print(drawn, file=sys.stderr if as_json else sys.stdout)


def _run_sweep(
    spec: SimSpec, grid: dict[str, list[Any]], args: argparse.Namespace, bar: tqdm[Any], runs: int
) -> SweepResult:
    def on_run(index: int, combo: dict[str, Any]) -> None:
        bar.set_description_str(
            f"[{index + 1}/{runs}] " + " ".join(f"{k}={v}" for k, v in combo.items())
        )

    result = sweep(spec, grid, target=args.target, on_run=on_run, on_step=lambda: bar.update(1))
    bar.close()
    return result


def _print_sweep(spec: SimSpec, result: SweepResult, plot: str | None, *, as_json: bool) -> None:
    from art_trio.sim.report import plot_sweep, sweep_summary, sweep_table

    plot_path = None if plot is None else plot_sweep(result, plot)
    if as_json:
        data = result.to_dict()
        data["plot"] = None if plot_path is None else str(plot_path)
        print(json.dumps(data, indent=2))
    else:
        print(f"Workload: {spec.describe()}")
        print(sweep_table(result))
        print()
        print(sweep_summary(result))
        if plot_path is not None:
            print(f"Plot: {plot_path}")
