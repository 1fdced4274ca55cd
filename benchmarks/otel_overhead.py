"""What watching a run costs: groups/s with and without the OpenTelemetry observer (and the
timeline recorder), on the scheduler-overhead workload at batch 32.

    python benchmarks/otel_overhead.py                 # 3 rounds of 300 steps, interleaved
    python benchmarks/otel_overhead.py --steps 100 --rounds 1

Zero-latency rollouts and training (the `overhead-b32` preset: 64 workers, batch 32, asyncio
rollouts under trio, the path ART users' code takes), so the trainer's own work is all there
is and an observer's cost shows in full. The OTel variant is a production setup: the SDK's
TracerProvider with a BatchSpanProcessor and an exporter that drops what it is given (what a
network exporter costs is the exporter's). Prints the median groups/s per variant and the
share each costs against none; `observer` is a do-nothing observer, what the trainer's own
bookkeeping for a listener costs whatever the observer does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import trio  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from art_trio import PipelineTrainer  # noqa: E402
from art_trio.otel import traced  # noqa: E402
from art_trio.sim import PRESETS  # noqa: E402
from art_trio.sim.doubles import SyntheticBackend, make_rollout_fn  # noqa: E402
from art_trio.sim.recorder import Recorder  # noqa: E402
from art_trio.sim.workloads import scenarios  # noqa: E402
from art_trio.testing import trainable_model  # noqa: E402
from art_trio.timeline import record_timeline  # noqa: E402


class Discard(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def _noop_log(*args: Any, **kwargs: Any) -> None:
    pass


Watch = Callable[[PipelineTrainer[Any, Any], Path], AbstractContextManager[Any]]


def _none(trainer: Any, tmp: Path) -> AbstractContextManager[Any]:
    return nullcontext()


@contextmanager
def _noop(trainer: Any, tmp: Path) -> Iterator[None]:
    # What any observer costs: the trainer measures some figures only while one listens.
    remove = trainer.add_observer(lambda event: None)
    try:
        yield
    finally:
        remove()


def _otel(trainer: Any, tmp: Path) -> AbstractContextManager[Any]:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return traced(trainer, provider)


def _timeline(trainer: Any, tmp: Path) -> AbstractContextManager[Any]:
    return record_timeline(trainer, tmp / "run.jsonl")


VARIANTS: dict[str, Watch] = {
    "none": _none,
    "observer": _noop,
    "otel": _otel,
    "timeline": _timeline,
}


def run_once(steps: int, watch: Watch) -> float:
    """Groups trained per second of wall time, one run."""
    workload = dataclasses.replace(PRESETS["overhead-b32"], steps=steps)
    recorder = Recorder(detailed=False)

    async def drive(tmp: Path) -> float:
        model: Any = trainable_model(
            name="otel-overhead", project="bench", base_model="bench", base_path=str(tmp)
        )
        backend = SyntheticBackend(workload.train_time, recorder, seed=0)
        await model.register(backend)
        object.__setattr__(model, "log", _noop_log)
        trainer: PipelineTrainer[Any, Any] = PipelineTrainer(
            model,
            backend,
            make_rollout_fn(workload, recorder, flavor="asyncio"),
            scenarios(None),
            None,
            num_rollout_workers=workload.workers,
            min_batch_size=workload.min_batch,
            max_batch_size=workload.max_batch,
            max_steps_off_policy=workload.max_steps_off_policy,
            max_steps=steps,
            log_interval_seconds=3600.0,
            resume=False,
        )
        started = time.perf_counter()
        with watch(trainer, tmp):
            await trainer.train(handle_signals=False)
        wall = time.perf_counter() - started
        return trainer.statistics().trained / wall

    with tempfile.TemporaryDirectory(prefix="otel-overhead-") as tmp:
        return trio.run(drive, Path(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, watch in VARIANTS.items():  # interleaved: drift hits every variant alike
            rates[name].append(run_once(args.steps, watch))
    base = statistics.median(rates["none"])
    print(f"overhead-b32, {args.steps} steps x {args.rounds} rounds (median groups/s)")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<9} {median:8.0f} groups/s   cost {1 - median / base:+.1%}")


if __name__ == "__main__":
    main()
