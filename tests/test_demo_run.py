"""The ``art-trio demo`` command end to end: art_trio's PipelineTrainer under trio.run with the
CPU backend, its summary, its reward plot, resuming, and the default run's promise."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402

from art_trio.demo.cli import (  # noqa: E402
    PROJECT,
    STATE_KEY,
    DemoOptions,
    build_parser,
    format_summary,
    main,
    run_demo,
)
from art_trio.demo.plot import plot_rewards, read_rewards  # noqa: E402
from tests.loops import require_trio_asyncio_patched_anyio

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def model_dir(output_dir: Path, name: str) -> Path:
    return output_dir / ".art" / PROJECT / "models" / name


def printed_plot_path(out: str) -> Path:
    match = re.search(r"^plot:\s+(\S+)$", out, re.MULTILINE)
    assert match, out
    return Path(match.group(1))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > len(PNG_MAGIC)


def test_demo_trains_prints_summary_writes_plot_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_trio_asyncio_patched_anyio()
    args = ["--output-dir", str(tmp_path), "--name", "short", "--eval-every", "3"]
    assert main([*args, "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "Training 'short': 6 steps from step 0" in out
    assert "Done: 6 steps (to step 6) in " in out and "to continue from step 6." in out
    assert re.search(r"val reward: 0\.\d{3} at step 0 -> [01]\.\d{3} at step 6", out), out

    plot = printed_plot_path(out)
    assert plot == model_dir(tmp_path, "short") / "reward.png"
    assert_png(plot)

    curves = read_rewards(model_dir(tmp_path, "short") / "history.jsonl")
    assert [step for step, _ in curves["val/reward"]] == [0, 3, 6]
    assert [step for step, _ in curves["train/reward"]] == [1, 2, 3, 4, 5, 6]
    checkpoints = model_dir(tmp_path, "short") / "checkpoints"
    assert {"0000", "0006"} <= {p.name for p in checkpoints.iterdir()}

    # Same name again: ART's resume picks up from the newest checkpoint (step 6).
    assert main([*args, "--steps", "2", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Training 'short': 2 steps from step 6" in out
    assert "Done: 2 steps (to step 8)" in out
    assert "plot:" not in out
    # Step 8 was not checkpointed (no eval): the summary says where the next run starts.
    assert "run again with --name short to continue from step 6." in out
    assert "(step 6 is the last checkpoint, not step 8: " in out
    assert main([*args, "--steps", "2", "--no-plot"]) == 0
    assert "Training 'short': 2 steps from step 6" in capsys.readouterr().out


def test_resuming_with_another_seed_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resumed run must draw the scenarios of the run it resumes, and --seed orders them:
    another seed is refused with what to do, exit status 2, not as the trainer's
    ForeignStateError in a traceback whose advice (resume=False, editing the state) is for
    code. With the seed on record, before the trainer touches the run's state."""
    require_trio_asyncio_patched_anyio()
    args = ["--output-dir", str(tmp_path), "--name", "seeded", "--steps", "2", "--no-plot"]
    assert main(args) == 0
    capsys.readouterr()
    state = model_dir(tmp_path, "seeded") / "state.json"
    before = state.read_bytes()
    assert main([*args, "--seed", "5"]) == 2
    assert capsys.readouterr() == (
        "",
        "art-trio demo: this run (--name seeded) was trained with --seed 0; resume it with "
        "the same --seed, or choose another --name\n",
    )
    assert state.read_bytes() == before

    # No record of the seed (the runs of the name were killed before writing it): the
    # trainer's refusal, said in one line.
    unrecorded = json.loads(before)
    del unrecorded[STATE_KEY]
    state.write_text(json.dumps(unrecorded))
    assert main([*args, "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "art-trio demo: this run (--name seeded) was trained with another --seed than 5; "
        "resume it with the --seed it was trained with, or choose another --name"
    )


def test_default_demo_run_learns_the_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The promise the README makes: the defaults take the untrained policy (about 0.75) to at
    least 0.95 of the optimum (1.0)."""
    require_trio_asyncio_patched_anyio()
    assert main(["--output-dir", str(tmp_path), "--name", "default"]) == 0
    out = capsys.readouterr().out
    steps = DemoOptions().steps
    assert f"Done: {steps} steps (to step {steps})" in out
    vals = read_rewards(model_dir(tmp_path, "default") / "history.jsonl")["val/reward"]
    (first_step, first), (last_step, last) = vals[0], vals[-1]
    assert (first_step, last_step) == (0, steps)
    assert 0.7 <= first <= 0.8
    assert last >= 0.95
    assert_png(printed_plot_path(out))


def test_the_same_demo_runs_under_asyncio(tmp_path: Path) -> None:
    options = DemoOptions(steps=4, eval_every=2, output_dir=tmp_path, name="aio", plot=False)
    result = asyncio.run(run_demo(options))
    assert (result.start_step, result.final_step, result.steps_trained) == (0, 4, 4)
    assert result.first_val is not None and result.first_val[0] == 0
    assert result.last_val is not None and result.last_val[0] == 4
    assert result.plot_path is None
    assert "Done: 4 steps (to step 4)" in format_summary(result)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--group-size", "1"], "argument --group-size: must be >= 2, got 1"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--learning-rate", "nan"], "argument --learning-rate: must be a finite number > 0"),
        (["--learning-rate", "inf"], "argument --learning-rate: must be a finite number > 0"),
        (["--learning-rate", "0"], "argument --learning-rate: must be a finite number > 0"),
        (["--workers", "two"], "argument --workers: 'two' is not an integer"),
        (["--loss-fn", "dpo"], "argument --loss-fn: invalid choice"),
    ],
)
def test_bad_flags_exit_with_usage_error(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(flags)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_an_output_dir_that_cannot_be_written_is_said_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    in_a_file = tmp_path / "a-file" / "runs"
    (tmp_path / "a-file").write_text("not a directory")
    assert main(["--output-dir", str(in_a_file)]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir '{in_a_file}' cannot be written: Not a directory" in err


def test_parser_defaults_match_demo_options() -> None:
    args = build_parser().parse_args([])
    d = DemoOptions()
    assert (args.steps, args.workers, args.seed, args.group_size) == (
        d.steps,
        d.workers,
        d.seed,
        d.group_size,
    )
    assert args.output_dir == Path(".")


def test_the_help_shows_each_options_default() -> None:
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert action.help is not None and "default" in action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    assert "--steps STEPS training steps to run (default: 30)" in text
    assert "--loss-fn {cispo,ppo} the policy-gradient objective (default: cispo)" in text
    assert "--learning-rate LEARNING_RATE Adam step size (default: 0.03)" in text


def test_plot_reads_history_rows_by_step_and_writes_png(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    rows: list[object] = [
        {"step": 0, "val/reward": 0.75},
        {"step": 1, "train/reward": 0.7, "train/loss": 0.1},
        {"step": 2, "train/reward": 0.8},
        {"step": 2, "val/reward": 0.9},
        {"step": 2, "val/reward": 0.8},  # averaged with the row above
        {"step": 2, "checkpoint/eval_completed": 1.0},
        {"val/reward": 0.1},  # no step: skipped
        [1, 2],  # not a row: skipped
    ]
    text = "\n".join(json.dumps(row) for row in rows) + "\n{truncated"
    history.write_text(text)
    curves = read_rewards(history)
    assert curves["val/reward"] == [(0, 0.75), (2, pytest.approx(0.85))]
    assert curves["train/reward"] == [(1, 0.7), (2, 0.8)]
    out = plot_rewards(history, tmp_path / "plots" / "reward.png")
    assert out == tmp_path / "plots" / "reward.png"
    assert_png(out)


@pytest.mark.parametrize(
    "title",
    [
        "smollm2-yes-no-maybe-20261204-093000: SmolLM2-135M, yes/no/maybe on a CPU (seed 0)",
        "yes-no-maybe-20261204-093000: yes/no/maybe on a CPU (seed 12)",
    ],
)
def test_the_plot_title_fits_the_figure(title: str) -> None:
    """The real-model demo's title (a timestamped run name and the task) was cut at both
    ends: the plot's title now fits the figure, every word kept."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from art_trio.demo.plot import fit_title

    fitted = fit_title(title)
    assert fitted.split() == title.split()
    fig = Figure(figsize=(7, 4), dpi=100)  # as plot_rewards draws it
    canvas = FigureCanvasAgg(fig)
    text = fig.add_subplot().set_title(fitted, fontsize=10)
    canvas.draw()
    box = text.get_window_extent(canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox)


def test_the_summary_says_which_step_the_last_val_reward_belongs_to(tmp_path: Path) -> None:
    """Evals run beside training and the run does not wait for those behind: a val reward of
    step 12 beside training to step 34 is said to be step 12's, and why."""
    from art_trio.demo.cli import DemoResult

    result = DemoResult(
        name="n", start_step=0, final_step=34, wall_seconds=9.0, first_val=(0, 0.762),
        last_val=(12, 0.98), history_path=tmp_path / "history.jsonl", plot_path=None,
    )  # fmt: skip
    summary = format_summary(result)
    assert "0.762 at step 0 -> 0.980 at step 12" in summary
    assert "step 12 is the last step evaluated, not step 34" in summary
    interrupted = format_summary(replace(result, stop_signal=2))
    assert interrupted.startswith("Stopped by SIGINT after 34 steps (at step 34)")
    assert "--name n to resume from step 34." in interrupted
    assert "last checkpoint" not in interrupted


def test_the_summary_says_which_step_a_resumed_run_starts_from(tmp_path: Path) -> None:
    """Only some steps are checkpointed: a run stopped at step 27 whose newest checkpoint is
    step 26 resumes from step 26, and the summary says so, not that step 27 is saved."""
    from art_trio.demo.cli import DemoResult

    result = DemoResult(
        name="n", start_step=0, final_step=27, wall_seconds=2.4, first_val=None, last_val=None,
        history_path=tmp_path / "history.jsonl", plot_path=None, resume_step=26,
    )  # fmt: skip
    done = format_summary(result).splitlines()
    assert done[0].endswith("; run again with --name n to continue from step 26.")
    assert done[1].startswith("  (step 26 is the last checkpoint, not step 27: ")
    stopped = format_summary(replace(result, stop_signal=2)).splitlines()
    assert stopped[0].startswith("Stopped by SIGINT after 27 steps (at step 27), 2.4 s; ")
    assert stopped[0].endswith("run again with --name n to resume from step 26.")
    assert "saved" not in stopped[0]


def test_the_summary_counts_one_step_in_the_singular(tmp_path: Path) -> None:
    from art_trio.demo.cli import DemoResult

    result = DemoResult(
        name="n", start_step=4, final_step=5, wall_seconds=1.0, first_val=None, last_val=None,
        history_path=tmp_path / "history.jsonl", plot_path=None,
    )  # fmt: skip
    assert format_summary(result).startswith("Done: 1 step (to step 5) in 1.0 s;")
    stopped = format_summary(replace(result, stop_signal=2))
    assert stopped.startswith("Stopped by SIGINT after 1 step (at step 5), 1.0 s;")
