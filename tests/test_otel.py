"""art_trio.otel against real runs: the spans say what the run's counters and fates say, and
none is left open however `train()` ends (returned, raised, cancelled)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import art
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from art_trio import PipelineTrainer, RunEvent, ScenarioSettled, StepTrained
from art_trio.otel import names, traced
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory


class OpenSpans(SpanProcessor):
    """Counts spans started and not yet ended: what `traced` must leave at zero."""

    def __init__(self) -> None:
        self.open: set[int] = set()
        self.started = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.open.add(span.context.span_id)
        self.started += 1

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.open.discard(span.context.span_id)


@pytest.fixture
def otel() -> tuple[TracerProvider, InMemorySpanExporter, OpenSpans]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    tracking = OpenSpans()
    provider.add_span_processor(tracking)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter, tracking


async def mixed_rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
    """Every fate a run can give: errors, zero variance, slow rollouts that go stale."""
    i = scenario["i"]
    if i % 7 == 3:
        raise ValueError("planned")
    if i % 7 == 5:
        return art.TrajectoryGroup([trajectory(1.0), trajectory(1.0)])
    if i % 5 == 1:
        await asyncio.sleep(0.4)  # virtual: several steps
    return await asyncio_rollout(model, scenario, config)


def _trainer(model: Any, backend: Any, rollout: Any = mixed_rollout, **kw: Any) -> Any:
    kw = {"num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 2, **kw}
    return PipelineTrainer(model, backend, rollout, scenarios(200), None, **kw)


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    spans: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


async def test_the_spans_say_what_the_run_counted(
    model: art.TrainableModel, backend: RecordingBackend, otel: Any, autojump_clock: Any
) -> None:
    provider, exporter, tracking = otel
    backend.train_seconds = 0.05
    trainer = _trainer(model, backend, max_steps=12, max_steps_off_policy=1)
    settled: dict[int, str] = {}
    trained: list[StepTrained] = []

    def watch(event: RunEvent) -> None:
        if isinstance(event, ScenarioSettled):
            settled[event.scenario_index] = event.fate.value
        elif isinstance(event, StepTrained):
            trained.append(event)

    trainer.add_observer(watch)
    with traced(trainer, provider, attributes={"run.name": "test"}):
        await trainer.train(handle_signals=False)
    stats = trainer.statistics()

    assert not tracking.open and tracking.started == len(exporter.get_finished_spans())
    spans = _by_name(exporter)
    (run,) = spans[names.RUN]
    rollouts, calls = spans[names.ROLLOUT], spans[names.TRAIN]
    assert len(rollouts) == stats.rollouts_started
    assert len(calls) == stats.steps == 12
    # Every rollout is the run's child, and carries the fate the run settled for it.
    assert all(s.parent is not None and s.parent.span_id == run.context.span_id for s in rollouts)
    fates = {s.attributes[names.SCENARIO]: s.attributes[names.FATE] for s in rollouts}
    assert fates == settled
    counted = Counter(fates.values())
    assert counted["trained"] == stats.trained
    assert counted["errored"] == stats.errored > 0
    assert counted["zero_variance"] == stats.zero_variance > 0
    assert counted["cancelled_stale"] + counted["stale"] == stats.stale > 0
    # A cancelled rollout says so with an event; a trained group carries its age and wait.
    cancelled = [s for s in rollouts if s.attributes[names.FATE] == "cancelled_stale"]
    assert cancelled and all([e.name for e in s.events] == [names.EV_CANCELLED] for s in cancelled)
    ages = {i: a for t in trained for i, a in zip(t.scenario_indices, t.staleness, strict=True)}
    for span in rollouts:
        if span.attributes[names.FATE] == "trained":
            assert span.attributes[names.AGE_STEPS] == ages[span.attributes[names.SCENARIO]]
            # Without weights updated under a rollout, every token is its start version's.
            assert span.attributes[names.AGE_TOKENS] == span.attributes[names.AGE_STEPS]
            assert span.attributes[names.QUEUED_S] >= 0
    # Training calls: their step, groups and the version each published.
    assert sorted(s.attributes[names.STEP] for s in calls) == list(range(1, 13))
    assert all(s.attributes[names.PUBLISHED] == s.attributes[names.STEP] for s in calls)
    assert all(s.attributes[names.GROUPS] == 2 for s in calls)
    published = [e for e in run.events if e.name == names.EV_PUBLISHED]
    assert [e.attributes["version"] for e in published] == list(range(1, 13))
    assert run.attributes[names.OUTCOME] == "returned" and run.attributes["run.name"] == "test"
    assert run.attributes["art_trio.run.rollouts_started"] == stats.rollouts_started
    # Lanes are worker slots: never more than the workers.
    assert {s.attributes[names.LANE] for s in rollouts} <= set(range(4))


async def test_nothing_is_left_open_when_train_raises(
    model: art.TrainableModel, backend: RecordingBackend, otel: Any, autojump_clock: Any
) -> None:
    provider, exporter, tracking = otel
    backend.fail_on_step = 3
    backend.train_seconds = 0.05
    trainer = _trainer(model, backend, asyncio_rollout, max_steps=10)
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the backend double's error)
        with traced(trainer, provider):
            await trainer.train(handle_signals=False)
    assert not tracking.open
    spans = _by_name(exporter)
    (run,) = spans[names.RUN]
    assert run.status.status_code is StatusCode.ERROR
    # The error train() raised inside its group, not the group.
    assert run.status.description == "RuntimeError: backend exploded at step 3"
    assert isinstance(raised.value, ExceptionGroup)
    assert run.attributes[names.OUTCOME] == "raised"
    assert len(spans[names.ROLLOUT]) == trainer.statistics().rollouts_started
    # The failed call's span ended as not completed.
    failed = [s for s in spans[names.TRAIN] if s.attributes[names.STEP] == 3]
    assert [s.attributes[names.COMPLETED] for s in failed] == [False]


async def test_nothing_is_left_open_when_train_is_cancelled(
    model: art.TrainableModel, backend: RecordingBackend, otel: Any, autojump_clock: Any
) -> None:
    provider, exporter, tracking = otel
    backend.train_seconds = 0.05
    trainer = _trainer(model, backend, mixed_rollout)  # endless: only the cancel ends it
    with trio.move_on_after(0.33) as scope, traced(trainer, provider):
        await trainer.train(handle_signals=False)
    assert scope.cancelled_caught
    assert not tracking.open
    spans = _by_name(exporter)
    (run,) = spans[names.RUN]
    assert run.attributes[names.OUTCOME] == "cancelled", run.events
    assert any(e.name == names.EV_RUN_CANCELLED for e in run.events)
    assert run.status.status_code is not StatusCode.ERROR
    assert len(spans[names.ROLLOUT]) == trainer.statistics().rollouts_started
    assert spans[names.TRAIN]


def test_the_global_provider_is_the_default(
    model: art.TrainableModel, backend: RecordingBackend, otel: Any, monkeypatch: Any
) -> None:
    from opentelemetry import trace

    provider, exporter, _ = otel
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    trainer = _trainer(model, backend, asyncio_rollout, max_steps=2)

    async def main() -> None:
        with traced(trainer):
            await trainer.train(handle_signals=False)

    asyncio.run(main())  # under asyncio too: the trainer's own asyncio form
    assert len(_by_name(exporter)[names.TRAIN]) == 2
