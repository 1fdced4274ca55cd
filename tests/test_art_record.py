"""The kernel's own record (`resume=False`): ART's `_pipeline_trainer` in state.json, written with
the checkpoints, no journal and no lock; a later durable resume follows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer, RunEvent, RunProgress, ScenarioBook
from art_trio.messages.events import TrainCallStarted
from art_trio.plumbing.progress import PIPELINE_STATE_KEY
from art_trio.resume.files import JOURNAL_FILE, SIDECAR_FILE
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory


async def _eval(model: Any, step: int, config: Any) -> list[art.Trajectory]:
    return [trajectory(1.0)]


def _record(model: art.TrainableModel) -> dict[str, Any]:
    return (model.read_state() or {})[PIPELINE_STATE_KEY]


async def test_a_plain_run_writes_arts_record_with_each_checkpoint_and_no_journal(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    seen: dict[int, int] = {}

    def heard(event: RunEvent) -> None:
        if isinstance(event, TrainCallStarted):
            seen[event.step] = _record(model)["training_step"]

    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, _eval,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps=5,
        eval_every_n_steps=2, resume=False,
    )
    trainer.add_observer(heard)
    await trainer.train(handle_signals=False)
    # Before each train call the record is at the newest step whose checkpoint was asked for
    # (the eval steps 0, 2, 4): never ahead of what a restarted backend comes back at.
    assert seen == {1: 0, 2: 0, 3: 2, 4: 2, 5: 4}
    end = _record(model)
    assert end["training_step"] == 5 and end["journal"] is False
    assert end["total_scenarios_consumed"] == trainer.statistics().rollouts_started
    out = Path(model._get_output_dir())
    assert not (out / SIDECAR_FILE).exists() and not (out / JOURNAL_FILE).exists()


async def test_a_durable_resume_after_a_plain_run_continues_from_its_record(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """An older durable run's snapshot is there too: the plain run's newer record wins, so the
    resumed run skips what the plain run consumed (ART's granularity), never the old ledger."""
    settings: dict[str, Any] = {
        "num_rollout_workers": 2, "min_batch_size": 2, "max_batch_size": 2,
        "eval_every_n_steps": 0, "eval_step_0": False,
    }
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, max_steps=1, **settings
    ).train(handle_signals=False)
    assert (Path(model._get_output_dir()) / SIDECAR_FILE).exists()
    plain = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, max_steps=3, resume=False,
        **settings,
    )
    await plain.train(handle_signals=False)
    consumed = _record(model)["total_scenarios_consumed"]
    trained_before = len(backend.calls)
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, max_steps=4, **settings
    ).train(handle_signals=False)
    resumed = [i for call in backend.calls[trained_before:] for i in call.scenario_ids]
    assert resumed and min(resumed) >= consumed, (consumed, resumed)


def _tear_state_json(model: art.TrainableModel) -> None:
    out = Path(model._get_output_dir())
    out.mkdir(parents=True, exist_ok=True)
    (out / "state.json").write_text('{"_pipeline_trainer": {"scenario_off')


async def test_a_torn_state_json_is_rewritten_with_the_runs_record(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock,
    caplog: Any,
) -> None:
    """A kill during an earlier in-place write of state.json left it torn: the plain run says
    so and writes its own record, instead of failing at its first step."""
    _tear_state_json(model)
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(20), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, max_steps=2, resume=False,
    ).train(handle_signals=False)
    assert _record(model)["training_step"] == 2
    assert "state.json is unreadable" in caplog.text


def test_an_admission_policy_missing_a_member_is_refused_naming_them(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    class Half:
        def headroom(self, s: Any) -> float:
            return 1.0

    with pytest.raises(ValueError, match="admission must be .*take_batch.*gate_class"):
        PipelineTrainer(model, backend, asyncio_rollout, scenarios(4), None, admission=Half())


class _Consumed(ScenarioBook):
    """Every scenario below `watermark` is settled: ART's granularity, kept elsewhere."""

    def __init__(self, watermark: int) -> None:
        self.watermark = watermark

    def is_resolved(self, index: int) -> bool:
        return index < self.watermark


class _RowKeeper:
    """A resume store of one's own (a database row, say): a dict, and every call it heard."""

    where = "a dict"

    def __init__(self, row: dict[str, Any]) -> None:
        self.row, self.calls = row, []

    def acquire(self) -> None:
        self.calls.append("acquire")

    def release(self) -> None:
        self.calls.append("release")

    def open(self, start_step: int, *, resume: bool) -> tuple[RunProgress, bool]:
        self.calls.append("open")
        consumed = self.row.get("consumed", 0) if resume else 0
        progress = RunProgress(
            ledger=_Consumed(consumed), training_step=start_step,
            total_scenarios_consumed=consumed,
        )
        return progress, bool(consumed)

    def record(self, progress: RunProgress) -> None:
        self.calls.append("record")
        self.row.update(consumed=progress.total_scenarios_consumed, step=progress.training_step)

    def snapshot(self, progress: RunProgress) -> None:
        self.record(progress)

    def close(self) -> None:
        self.calls.append("close")


async def test_a_progress_keeper_of_ones_own_is_used_and_resumed_from(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    row: dict[str, Any] = {}
    keepers: list[_RowKeeper] = []

    def keeper(model: Any) -> _RowKeeper:
        keepers.append(_RowKeeper(row))
        return keepers[-1]

    settings: dict[str, Any] = {
        "num_rollout_workers": 2, "min_batch_size": 2, "max_batch_size": 2,
        "eval_every_n_steps": 0, "eval_step_0": False, "progress_keeper": keeper,
    }
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, max_steps=3, **settings
    ).train(handle_signals=False)
    first = keepers[0].calls
    assert first[:2] == ["acquire", "open"] and first[-2:] == ["close", "release"]
    assert first.count("record") >= 3 and row["step"] == 3
    out = Path(model._get_output_dir())
    assert not (out / SIDECAR_FILE).exists()  # the durable store was never composed
    consumed, trained_before = row["consumed"], len(backend.calls)
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(40), None, max_steps=5, **settings
    ).train(handle_signals=False)
    resumed = [i for call in backend.calls[trained_before:] for i in call.scenario_ids]
    assert resumed and min(resumed) >= consumed


def test_what_is_not_an_extension_is_refused_at_construction(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    with pytest.raises(TypeError, match="StageExtension .* got int"):
        PipelineTrainer(model, backend, asyncio_rollout, scenarios(4), None, extensions=[3])
    with pytest.raises(TypeError, match="progress_keeper must be a function of the model"):
        PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(4), None, progress_keeper="state.json"
        )


def _two_steps_with(
    model: art.TrainableModel, backend: RecordingBackend, extension: Any
) -> PipelineTrainer[Any, None]:
    """A trainer of two steps with `extension` beside its stages."""
    return PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(20), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, max_steps=2, extensions=[extension],
    )


class _Forever:
    """A careless extension: its stage never returns and never looks at the run's end."""

    def stage(self, run: Any) -> Any:
        class Stage:
            name = "forever"

            async def __call__(self) -> None:
                await trio.sleep_forever()

        return Stage()


async def test_an_extension_stage_that_never_returns_does_not_keep_train_running(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    trainer = _two_steps_with(model, backend, _Forever())
    with trio.fail_after(3600):  # virtual time: a hang fails here instead of hanging the suite
        await trainer.train(handle_signals=False)
    assert trainer.statistics().steps == 2


class _Raising:
    def stage(self, run: Any) -> Any:
        class Stage:
            name = "raising"

            async def __call__(self) -> None:
                raise KeyError("the extension's own bug")

        return Stage()


async def test_an_extension_stage_that_raises_fails_the_run_naming_it(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    trainer = _two_steps_with(model, backend, _Raising())
    with pytest.raises(BaseExceptionGroup) as caught:
        await trainer.train(handle_signals=False)
    (leaf,) = caught.value.exceptions
    assert isinstance(leaf, KeyError)
    assert "raised in art_trio's raising stage" in leaf.__notes__
