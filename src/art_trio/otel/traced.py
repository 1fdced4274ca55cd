"""`traced(trainer)`: the runs inside a `with` block as OpenTelemetry spans.

    from art_trio.otel import traced

    with traced(trainer):            # the global TracerProvider, or tracer_provider=...
        await trainer.train()

The block is the run's span: entering it opens `art_trio.run` and registers a `RunTracer` as
the trainer's observer; leaving it, however (train() returned, raised, or was cancelled),
removes the observer, ends every span still open and ends the run's span with the outcome
and the run's counters. A plain `with` works under trio, anyio and asyncio alike, and the
block's own code (a nursery around `trainer.train`) is traced with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import TracerProvider

from art_trio.timeline.recorder import how_it_ended, run_errors, run_started_fields

from .tracer import RunTracer

if TYPE_CHECKING:
    from art_trio import PipelineTrainer, RunStatistics


@contextmanager
def traced(
    trainer: PipelineTrainer[Any, Any],
    tracer_provider: TracerProvider | None = None,
    *,
    attributes: dict[str, Any] | None = None,
) -> Iterator[RunTracer]:
    """Trace the runs of `trainer` inside the block as one `art_trio.run` span and its
    children; `attributes` are added to the run's span (a run name, a git commit...)."""
    tracer = RunTracer(tracer_provider)
    started = run_started_fields(trainer)
    run_attributes = {
        f"art_trio.run.{key}": value for key, value in started.items() if value is not None
    }
    run_attributes.update(attributes or {})
    tracer.start(
        run_attributes,
        policy_version=started["policy_version"],
        read_policy_version=lambda: trainer.statistics().policy_version,
    )
    remove = trainer.add_observer(tracer)
    outcome, error = "returned", None
    try:
        yield tracer
    except BaseException as exc:
        outcome, _ = how_it_ended(exc)
        # train() raises a stage's error in a group: the span records the error itself.
        error = next(iter(run_errors(exc)), exc)
        raise
    finally:
        remove()
        statistics: RunStatistics | None
        try:
            statistics = trainer.statistics()
        except Exception:  # the run's own error, if any, is the one to raise
            statistics = None
        tracer.finish(outcome, error, statistics)
