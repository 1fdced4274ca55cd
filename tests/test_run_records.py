"""A run's records (the timeline log, the OpenTelemetry spans) tell what happened when the run
does not go to plan: killed mid-run, failed, resumed at a later step, or with a full disk
under the log. Real trainers on the doubles, under trio's MockClock."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import art
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from art_trio import PipelineTrainer, PolicyPublished, RunEvent
from art_trio.otel import names, traced
from art_trio.timeline import load_timeline, record_timeline
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios


def _trainer(model: Any, backend: Any, **kw: Any) -> PipelineTrainer[Any, Any]:
    kw = {"num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 2, **kw}
    return PipelineTrainer(model, backend, asyncio_rollout, scenarios(40), None, **kw)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


async def test_the_log_on_disk_holds_each_step_as_it_is_trained(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> None:
    """What a process killed after step 2 leaves: the file read at that instant (the
    recorder's buffer lost with the process) already holds the run up to that step."""
    log = tmp_path / "run.jsonl"
    trainer = _trainer(model, backend, max_steps=4)
    on_disk: dict[int, list[dict[str, Any]]] = {}

    def read_the_file(event: RunEvent) -> None:
        if isinstance(event, PolicyPublished):
            on_disk[event.version] = _events(log)

    with record_timeline(trainer, log):
        trainer.add_observer(read_the_file)
        await trainer.train(handle_signals=False)
    for version, events in on_disk.items():
        assert events[0]["event"] == "RunStarted"
        assert [e["version"] for e in events if e["event"] == "PolicyPublished"] == list(
            range(1, version + 1)
        )
    assert sorted(on_disk) == [1, 2, 3, 4]


async def test_a_failed_run_records_the_error_not_the_group_around_it(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> None:
    backend.fail_on_step = 2
    log = tmp_path / "failed.jsonl"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trainer = _trainer(model, backend, max_steps=5)
    with pytest.raises(ExceptionGroup) as raised:
        with record_timeline(trainer, log), traced(trainer, provider):
            await trainer.train(handle_signals=False)
    (error,) = raised.value.exceptions
    said = f"{type(error).__name__}: {error}"
    assert "ExceptionGroup" not in said
    ended = _events(log)[-1]
    assert (ended["event"], ended["outcome"], ended["error"]) == ("RunEnded", "raised", said)
    (run,) = [s for s in exporter.get_finished_spans() if s.name == names.RUN]
    assert run.status.status_code is StatusCode.ERROR and run.status.description == said
    assert [e.attributes["exception.type"] for e in run.events if e.name == "exception"] == [
        type(error).__name__
    ]


async def test_a_run_resumed_at_a_later_step_is_recorded_from_that_step(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> None:
    """Before train() the trainer cannot know the backend's step: the records read the
    version the run starts from once it runs (ART's own record of step 5 here)."""
    await _trainer(model, backend, max_steps=5).train(handle_signals=False)
    log = tmp_path / "resumed.jsonl"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    again = _trainer(model, backend, max_steps=2)
    with record_timeline(again, log), traced(again, provider):
        await again.train(handle_signals=False)
    started = _events(log)[0]
    assert (started["event"], started["policy_version"]) == ("RunStarted", 5)
    assert started["t"] <= _events(log)[1]["t"]  # timed when the block began
    assert {r.start_version for r in load_timeline(log).rollouts} >= {5}
    (run,) = [s for s in exporter.get_finished_spans() if s.name == names.RUN]
    assert run.attributes[names.RUN_POLICY_VERSION] == 5
    first_rollouts = [
        s for s in exporter.get_finished_spans()
        if s.name == names.ROLLOUT and s.attributes[names.START_VERSION] < 5
    ]
    assert first_rollouts == []


class _FillsUp:
    """The log's file on a disk that fills up after `room` writes: ENOSPC from then on (the
    one double here: a real disk cannot be filled from a test)."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, text: str) -> int:
        self.room -= 1
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.file.write(text))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


async def test_a_disk_that_fills_up_stops_the_recording_not_the_training(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path, autojump_clock: Any
) -> None:
    log = tmp_path / "run.jsonl"
    trainer = _trainer(model, backend, max_steps=3)
    with pytest.warns(RuntimeWarning, match="could not be written .*training goes on") as said:
        with record_timeline(trainer, log) as recorder:
            recorder.writer._file = _FillsUp(recorder.writer._file, room=20)
            await trainer.train(handle_signals=False)
    assert trainer.statistics().steps == 3
    assert isinstance(recorder.failed, OSError) and len(said) == 1
    assert recorder.writer.closed


def test_a_log_that_cannot_be_written_at_all_is_said_before_anything_runs(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (a device every write to fails with ENOSPC)")
    trainer = _trainer(model, backend, max_steps=3)
    ran = False
    with pytest.raises(OSError, match="No space left"), record_timeline(trainer, "/dev/full"):
        ran = True
    assert not ran
