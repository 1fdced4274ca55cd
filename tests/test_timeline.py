"""art_trio.timeline: a real run recorded, read back, drawn and written as a Perfetto trace;
the simulator draws the same picture; every bad log gives an error naming the file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer, RunEvent, ScenarioSettled
from art_trio import cli as art_trio_cli
from art_trio.timeline import (
    FATES,
    FORMAT,
    TimelineError,
    draw,
    load_timeline,
    record_timeline,
    trace_events,
)
from art_trio.timeline.cli import main as timeline_main
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios
from tests.test_otel import mixed_rollout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _trainer(model: Any, backend: Any, rollout: Any = mixed_rollout, **kw: Any) -> Any:
    kw = {"num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 2, **kw}
    return PipelineTrainer(model, backend, rollout, scenarios(200), None, **kw)


@pytest.fixture
async def recorded(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> tuple[Path, Any, dict[int, str]]:
    backend.train_seconds = 0.05
    trainer = _trainer(model, backend, max_steps=10, max_steps_off_policy=1)
    settled: dict[int, str] = {}

    def watch(event: RunEvent) -> None:
        if isinstance(event, ScenarioSettled):
            settled[event.scenario_index] = event.fate.value

    trainer.add_observer(watch)
    log = tmp_path / "run.jsonl"
    with record_timeline(trainer, log):
        await trainer.train(handle_signals=False)
    return log, trainer.statistics(), settled


async def test_a_recorded_run_reads_back_as_it_ran(recorded: Any) -> None:
    log, stats, settled = recorded
    header = json.loads(log.read_text().splitlines()[0])
    assert header["format"] == FORMAT and header["version"] == 1
    run = load_timeline(log)
    assert run.outcome == "returned"
    assert len(run.rollouts) == stats.rollouts_started
    assert {r.scenario_index: r.fate for r in run.rollouts} == settled
    counts = run.fate_counts()
    assert counts["trained"] == stats.trained and counts["errored"] == stats.errored
    assert counts["cancelled_stale"] + counts["stale"] == stats.stale
    assert [c.step for c in run.train_calls] == list(range(1, 11))
    assert [v for _, v in run.publishes] == list(range(1, 11))
    assert 1 <= run.lanes <= 4
    # Staleness per trained group: from its start, and its seconds queued.
    assert sum(len(s.ages) for s in run.steps) == stats.trained
    assert dict(Counter(a for s in run.steps for a in s.ages)) == dict(stats.staleness)
    trained = [r for r in run.rollouts if r.fate == "trained"]
    assert all(r.step is not None and r.queued_s is not None and r.queued_s >= 0 for r in trained)
    # No two rollouts share a lane at once.
    for lane in range(run.lanes):
        bars = sorted((r.start, r.end) for r in run.rollouts if r.lane == lane)
        assert all(a[1] <= b[0] for a, b in zip(bars, bars[1:], strict=False))


async def test_the_picture_has_a_bar_per_rollout_coloured_by_fate(
    recorded: Any, tmp_path: Path
) -> None:
    log, stats, _ = recorded
    run = load_timeline(log)
    png = tmp_path / "run.png"
    figure = draw(run, png, dpi=60)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    bars = {
        c.get_gid(): len(c.get_paths()) for c in figure.axes[0].collections if c.get_gid() in FATES
    }
    assert bars == {fate: n for fate, n in run.fate_counts().items() if n}
    assert sum(bars.values()) == stats.rollouts_started
    # Each bar has an edge of its own shade: back-to-back rollouts on a lane stay apart.
    for c in figure.axes[0].collections:
        if c.get_gid() in FATES:
            edge, face = c.get_edgecolor(), c.get_facecolor()
            assert len(edge) == 1 and edge[0][3] == 1 and tuple(edge[0]) != tuple(face[0])
            assert c.get_linewidth()[0] > 0
    # Two runs drawn to one scale: the time axis ends where asked.
    assert draw(run, until=run.end - run.start + 5.0).axes[0].get_xlim()[1] == pytest.approx(
        run.end - run.start + 5.0
    )


async def test_no_legend_covers_an_axis_label_or_tick(recorded: Any) -> None:
    figure = draw(load_timeline(recorded[0]))
    figure.draw_without_rendering()  # lays the figure out as saving it would
    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend())]
    texts = [t for ax in figure.axes for t in (ax.yaxis.label, *ax.get_yticklabels())]
    assert len(legends) == 2 and any(t.get_text() == "queued (s)" for t in texts)
    for legend in legends:
        box = legend.get_window_extent()
        assert not [t.get_text() for t in texts if box.overlaps(t.get_window_extent())]


async def test_the_trace_opens_in_perfetto_with_a_slice_per_rollout(
    recorded: Any, tmp_path: Path
) -> None:
    log, stats, _ = recorded
    out = tmp_path / "run.trace.json"
    argv = ["timeline", str(log), "--png", str(tmp_path / "r.png"), "--trace", str(out)]
    assert art_trio_cli.main(argv) == 0  # `art-trio timeline ...`
    trace = json.loads(out.read_text())
    kinds = Counter((e["ph"], e.get("cat")) for e in trace["traceEvents"])
    assert kinds["X", "rollout"] == stats.rollouts_started
    assert kinds["X", "train"] == kinds["i", "publish"] == stats.steps == 10
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
    assert trace == json.loads(json.dumps(trace_events(load_timeline(log))))


async def test_the_log_says_how_the_run_ended(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> None:
    backend.fail_on_step = 2
    failing = tmp_path / "failing.jsonl"
    trainer = _trainer(model, backend, asyncio_rollout, max_steps=5)
    with pytest.raises(Exception):  # noqa: B017, PT011 (the backend double's planned error)
        with record_timeline(trainer, failing):
            await trainer.train(handle_signals=False)
    run = load_timeline(failing)
    assert run.outcome == "raised" and [c.completed for c in run.train_calls] == [True, False]

    backend.fail_on_step, backend.train_seconds = None, 0.05
    cancelled = tmp_path / "cancelled.jsonl"
    trainer = _trainer(model, backend, asyncio_rollout, resume=False)
    with trio.move_on_after(0.2), record_timeline(trainer, cancelled):
        await trainer.train(handle_signals=False)
    assert load_timeline(cancelled, require_steps=False).outcome == "cancelled"


def test_the_simulator_draws_the_same_picture(tmp_path: Path) -> None:
    from art_trio.sim.cli import main as simulate_main

    png, log = tmp_path / "plan.png", tmp_path / "plan.jsonl"
    argv = ["--rollout-latency", "exp:30", "--train-time", "60", "--workers", "8",
            "--min-batch-size", "4", "--max-batch-size", "4", "--steps", "6",
            "--timeline", str(png), "--timeline-log", str(log), "--json"]  # fmt: skip
    assert simulate_main(argv) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    run = load_timeline(log)
    assert len(run.steps) == 6 and run.lanes <= 8
    # Virtual seconds: six 60 s steps take at least six minutes of the run's clock.
    assert run.end - run.start >= 360


# --- bad input ------------------------------------------------------------------------------

HEADER = json.dumps({"format": FORMAT, "version": 1, "trainer": "art_trio"})
STARTED = '{"t": 0, "event": "RunStarted", "policy_version": 0}'
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads recurses per level: RecursionError


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ('{"some": "json"}\n', "not a timeline log's header"),
        ("not json at all\n", "not a timeline log's header"),
        (HEADER.replace('"version": 1', '"version": 99') + "\n", "version 99 is not one"),
        (f'{HEADER}\n{STARTED}\n{{"t": 1, "event": "Rollout', "the last, is cut short"),
        (f'{HEADER}\n{STARTED}\n{{"t": 1, "ev\n{STARTED}\n', "line 3 is not JSON"),
        (f'{HEADER}\n{STARTED}\n["t", 1]\n', "line 3 is not an event"),
        (f'{HEADER}\n{STARTED}\n{{"t": 1, "event": "BatchTaken"}}\n', "line 3 (BatchTaken)"),
        (f'{HEADER}\n{STARTED}\n{{"t": 1, "event": "X", "a": {DEEP}}}\n', "line 3 is nested too"),
        (f"{DEEP}\n", "not a timeline log's header"),
        (f'{HEADER}\n{STARTED}\n{{"t": Infinity, "event": "X"}}\n', '"t" is Infinity, not a'),
        (f'{HEADER}\n{STARTED}\n{{"t": NaN, "event": "X"}}\n', '"t" is NaN, not a finite'),
        (f'{HEADER}\n{STARTED}\n{{"t": "1", "event": "X"}}\n', 'line 3 (X) is garbled: "t"'),
        (f'{HEADER}\n{{"t": 1, "event": "RolloutStarted", "scenario_index": 1}}\n', "RunStarted"),
        (f'{HEADER}\n{STARTED}\n{{"t": 2, "event": "RunEnded"}}\n', "trained no step"),
    ],
    ids=[
        "missing",
        "empty",
        "no-header",
        "not-json",
        "version",
        "truncated",
        "garbled",
        "not-an-event",
        "missing-field",
        "deeply-nested",
        "deeply-nested-header",
        "t-infinite",
        "t-nan",
        "t-string",
        "no-run-started",
        "zero-steps",
    ],  # fmt: skip
)
def test_a_bad_log_names_the_file_and_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    log = tmp_path / "bad.jsonl"
    if content is not None:
        log.write_text(content)
    with pytest.raises(TimelineError, match=str(log)) as raised:
        load_timeline(log)
    assert message in str(raised.value)
    assert timeline_main([str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("art-trio timeline: error:") and message in err
    assert not (tmp_path / "bad.png").exists()  # nothing drawn from a bad log


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('"TrainCallStarted", "step": null', '"step" is null, not an integer'),
        ('"StepTrained", "step": true', '"step" is true, not an integer'),
        ('"PolicyPublished", "version": "1"', '"version" is "1", not an integer'),
        ('"PolicyPublished"', 'no "version"'),
        ('"Stalled", "seconds": NaN', '"seconds" is NaN, not a finite number'),
        ('"StepTrained", "step": 1, "staleness": [0.5]', '"staleness" is [0.5], not a list of'),
        ('"StepTrained", "step": 1, "token_ages": [Infinity, 1]', '"token_ages" is [Infinity'),
        ('"StepTrained", "step": 1, "token_staleness": ["0"]', '"token_staleness" is ["0"]'),
        ('"StepTrained", "step": 1, "scenario_indices": 1', '"scenario_indices" is 1, not'),
        ('"RolloutStarted", "scenario_index": [1]', '"scenario_index" is [1], not an integer'),
        ('"ScenarioSettled", "scenario_index": 1, "fate": 2', '"fate" is 2, not a string'),
        ('"GroupReceived", "scenario_index": 1, "policy_version": 0.5', '"policy_version" is 0.5'),
        ('"EvalEnded", "step": 0, "completed": "no"', '"completed" is "no", not true or false'),
        ('"RunEnded", "outcome": NaN', '"outcome" is NaN, not a string'),
    ],
    ids=[
        "step-null",
        "step-bool",
        "version-str",
        "no-version",
        "seconds-nan",
        "staleness",
        "token-ages",
        "token-staleness",
        "indices",
        "index",
        "fate",
        "group-version",
        "completed",
        "outcome",
    ],  # fmt: skip
)
def test_a_garbled_field_names_its_line_and_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    log = tmp_path / "garbled.jsonl"
    rollout = '{"t": 1, "event": "RolloutStarted", "scenario_index": 1}'
    log.write_text(f'{HEADER}\n{STARTED}\n{rollout}\n{{"t": 2, "event": {line}}}\n')
    event = line.split(",")[0].strip('"')
    with pytest.raises(TimelineError) as raised:
        load_timeline(log)
    assert str(raised.value).startswith(f"{log}: line 4 ({event}) is garbled: {message}")
    trace = tmp_path / "t.json"
    assert timeline_main([str(log), "--trace", str(trace)]) == 2
    assert message in capsys.readouterr().err and not trace.exists()


def test_a_garbled_run_started_names_its_line(tmp_path: Path) -> None:
    log = tmp_path / "garbled.jsonl"
    started = '{"t": 0, "event": "RunStarted", "policy_version": "0"}'
    log.write_text(f"{HEADER}\n{started}\n")
    with pytest.raises(TimelineError, match='line 2 .RunStarted. is garbled: "policy_version" is'):
        load_timeline(log)


def test_an_unreadable_log_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "loop.jsonl"
    log.symlink_to(log)  # reading it fails with ELOOP, as an unreadable file fails with EACCES
    with pytest.raises(TimelineError, match="loop.jsonl: cannot be read"):
        load_timeline(log)
    assert timeline_main([str(log)]) == 2
    assert "cannot be read (Too many levels of symbolic links)" in capsys.readouterr().err


def test_a_run_without_steps_draws_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text(f'{HEADER}\n{STARTED}\n{{"t": 2, "event": "RunEnded", "outcome": "x"}}\n')
    assert timeline_main([str(log)]) == 2
    err = capsys.readouterr().err  # the command's own flag, not the Python keyword
    assert "pass --allow-empty to draw it anyway" in err and "require_steps" not in err
    assert timeline_main([str(log), "--allow-empty"]) == 0
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


# --- the command's options and outputs ------------------------------------------------------

ONE_STEP = [
    HEADER,
    STARTED,
    '{"t": 1, "event": "RolloutStarted", "scenario_index": 0}',
    '{"t": 2, "event": "RolloutEnded", "scenario_index": 0, "spent_s": 1}',
    '{"t": 2, "event": "ScenarioSettled", "scenario_index": 0, "fate": "trained"}',
    '{"t": 3, "event": "StepTrained", "step": 1, "scenario_indices": [0], "staleness": [0]}',
    '{"t": 3, "event": "PolicyPublished", "version": 1}',
    '{"t": 4, "event": "RunEnded", "outcome": "returned"}',
]


@pytest.fixture
def one_step(tmp_path: Path) -> Path:
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(ONE_STEP) + "\n")
    return log


@pytest.mark.parametrize(
    "option",
    [
        ["--dpi", "0"],
        ["--dpi", "1.5"],
        ["--until", "nan"],
        ["--until", "inf"],
        ["--until", "-1"],
        ["--until", "0"],
    ],
    ids=["dpi-0", "dpi-float", "until-nan", "until-inf", "until-negative", "until-0"],
)
def test_a_bad_option_value_is_refused_before_drawing(
    one_step: Path, capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        timeline_main([str(one_step), *option])
    assert exited.value.code == 2
    assert f"error: argument {option[0]}: " in capsys.readouterr().err
    assert not one_step.with_suffix(".png").exists()


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["--png", "missing/r.png"], "no such directory"),
        (["--png", "r.png", "--trace", "missing/t.json"], "no such directory"),
        (["--png", "adir"], "is a directory"),
        (["--trace", "adir"], "is a directory"),
        (["--png", "run.jsonl"], "is the log itself"),
        (["--trace", "r.json", "--png", "r.json"], "--png and --trace name the same file"),
        (["--png", "a" * 300], "cannot be written (File name too long)"),
    ],
    ids=["png-dir", "trace-dir", "png-is-dir", "trace-is-dir", "the-log", "same", "too-long"],
)
def test_an_output_that_cannot_be_written_is_an_error_and_nothing_is_written(
    one_step: Path, capsys: pytest.CaptureFixture[str], outputs: list[str], message: str
) -> None:
    folder = one_step.parent
    (folder / "adir").mkdir()
    before = sorted(folder.iterdir())
    argv = [str(one_step), *(o if o.startswith("--") else str(folder / o) for o in outputs)]
    assert timeline_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("art-trio timeline: error:") and message in err
    assert sorted(folder.iterdir()) == before  # no picture drawn before a bad trace is found
    assert one_step.read_text() == "\n".join(ONE_STEP) + "\n"


def test_the_picture_is_written_to_exactly_the_path_given(
    one_step: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = one_step.parent / "mypicture"  # no suffix: still this file, not mypicture.png
    assert timeline_main([str(one_step), "--png", str(picture), "--dpi", "30"]) == 0
    assert picture.read_bytes().startswith(PNG_MAGIC)
    assert not picture.with_suffix(".png").exists()
    assert f"Picture: {picture}\n" in capsys.readouterr().out


def test_the_title_counts_one_step_and_one_rollout_in_the_singular(one_step: Path) -> None:
    run = load_timeline(one_step)
    title = draw(run, dpi=30).axes[0].get_title()
    assert title.splitlines()[0] == f"{run.trainer}: 1 step, 1 rollout"


def test_a_trace_alone_is_written_without_a_picture_or_matplotlib(
    one_step: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: imports fail
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = one_step.parent / "run.trace.json"
    assert timeline_main([str(one_step), "--trace", str(trace)]) == 0
    assert json.loads(trace.read_text())["otherData"]["outcome"] == "returned"
    assert not one_step.with_suffix(".png").exists()
    assert capsys.readouterr().out.startswith("Trace: ")
    # A picture asked for without matplotlib: what to install, and that a trace needs none.
    assert timeline_main([str(one_step)]) == 2
    assert "needs matplotlib: pip install 'art-trio[plot]'" in capsys.readouterr().err


def test_arts_own_trainer_recorded_from_outside_draws_alike(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path
) -> None:
    """ART's trainer emits no events: its rollout function and backend.train, wrapped, write
    the same log, and what it says matches what the backend trained."""
    import asyncio

    from art_trio.bench.outside import OutsideRecorder
    from art_trio.testing import art_pipeline_trainer, art_trainer_kwargs

    log = tmp_path / "art.jsonl"
    recorder = OutsideRecorder(log, trainer="art", num_rollout_workers=4)
    backend.train = recorder.train(backend.train)  # type: ignore[method-assign]
    cls = art_pipeline_trainer()

    async def run() -> None:
        with pytest.MonkeyPatch.context() as patch:
            # The check imports art.local.backend (torch); the double is no LocalBackend.
            patch.setattr(cls, "_validate_backend_support", lambda self: None)
            trainer = cls(
                model, backend, recorder.rollout(asyncio_rollout), scenarios(40), None,
                **art_trainer_kwargs(num_rollout_workers=4, min_batch_size=2, max_batch_size=2,
                                     max_steps=5, log_interval_seconds=3600.0),
            )  # fmt: skip
            with recorder:
                await trainer.train(handle_signals=False)

    loop = asyncio.SelectorEventLoop()  # as tests/test_cpu_llm.py runs ART's trainer
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    run_ = load_timeline(log)
    assert run_.trainer == "art" and run_.outcome == "returned"
    assert [c.step for c in run_.train_calls] == [call.step for call in backend.calls]
    trained = sorted(i for call in backend.calls for i in call.scenario_ids)
    assert sorted(r.scenario_index for r in run_.rollouts if r.fate == "trained") == trained
    assert not run_.fate_counts()["unsettled"]
    assert len(draw(run_, tmp_path / "art.png", dpi=50).axes) >= 2


def test_a_resumed_runs_start_version_follows_its_first_publish(tmp_path: Path) -> None:
    """The recorder reads the start version before train() (0 until the run starts): a run
    resumed at step 3 publishes 4 first, so its first rollouts sampled version 3."""
    log = tmp_path / "resumed.jsonl"
    lines = [
        HEADER,
        STARTED,
        '{"t": 1, "event": "RolloutStarted", "scenario_index": 7}',
        '{"t": 2, "event": "RolloutEnded", "scenario_index": 7, "spent_s": 1}',
        '{"t": 2, "event": "ScenarioSettled", "scenario_index": 7, "fate": "trained"}',
        '{"t": 3, "event": "StepTrained", "step": 4, "batch_size": 1, "scenario_indices": [7],'
        ' "staleness": [0], "token_ages": [0, 10]}',
        '{"t": 3, "event": "PolicyPublished", "version": 4}',
        '{"t": 4, "event": "RolloutStarted", "scenario_index": 8}',
        '{"t": 5, "event": "RunEnded", "outcome": "returned"}',
    ]
    log.write_text("\n".join(lines) + "\n")
    run = load_timeline(log)
    versions = {r.scenario_index: r.start_version for r in run.rollouts}
    assert versions == {7: 3, 8: 4}
    assert [(r.scenario_index, r.fate) for r in run.rollouts] == [(7, "trained"), (8, "unsettled")]
    assert run.steps[0].token_age == 0.0 and run.steps[0].ages == (0,)
