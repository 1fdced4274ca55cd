"""See a run: its spans sent to an OpenTelemetry backend, and its timeline drawn.

The CPU demo's task, traced with `art_trio.otel.traced` and recorded with
`art_trio.timeline.record_timeline`, then drawn as a PNG and written as a Perfetto trace.
With `OTEL_EXPORTER_OTLP_ENDPOINT` set (e.g. http://localhost:4318 for a local Jaeger) the
spans go there over OTLP; without it they are kept in memory and counted.

    pip install 'art-trio[demo,otel]'
    python examples/see_a_run.py        # see-a-run.png, see-a-run.trace.json, see-a-run.jsonl
"""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402
import trio  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from art_trio import PipelineRuntimeConfig, PipelineTrainer, trainable_model  # noqa: E402
from art_trio.demo import CpuBackend, TaskConfig, eval_fn, rollout, scenarios, start_over  # noqa: E402
from art_trio.otel import traced  # noqa: E402
from art_trio.timeline import draw, load_timeline, record_timeline, write_trace  # noqa: E402

STEPS = 4


def tracer_provider() -> tuple[TracerProvider, InMemorySpanExporter | None]:
    kept = None
    # --8<-- [start:provider]
    provider = TracerProvider(resource=Resource.create({"service.name": "my-rl-run"}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):  # Jaeger, Tempo, Logfire, a collector
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # --8<-- [end:provider]
    else:  # no backend here: keep the spans in memory and count them
        kept = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(kept))
    return provider, kept


async def main() -> None:
    model: art.TrainableModel = trainable_model(
        name="see-a-run", project="examples", base_model="cpu-demo"
    )
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    provider, kept = tracer_provider()
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)
        trainer = PipelineTrainer(
            model, backend, rollout, scenarios(0), TaskConfig(), eval_fn,
            pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=2),
            max_steps_off_policy=1, max_steps=STEPS,
        )  # fmt: skip
        # --8<-- [start:watch]
        with traced(trainer, provider), record_timeline(trainer, "see-a-run.jsonl"):
            await trainer.train()
        # --8<-- [end:watch]
    provider.shutdown()  # sends what the batch processor still holds
    # --8<-- [start:draw]
    run = load_timeline("see-a-run.jsonl")
    draw(run, "see-a-run.png")
    write_trace(run, "see-a-run.trace.json")  # open at https://ui.perfetto.dev
    # --8<-- [end:draw]
    print(f"timeline: {len(run.steps)} steps, {len(run.rollouts)} rollouts, {run.fate_counts()}")
    if kept is not None:
        spans = Counter(span.name for span in kept.get_finished_spans())
        print(f"spans: {dict(spans)}")


if __name__ == "__main__":
    trio.run(main)
