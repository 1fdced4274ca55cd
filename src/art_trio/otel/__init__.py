"""A run as OpenTelemetry traces: `pip install 'art-trio[otel]'`.

    from art_trio.otel import traced

    with traced(trainer, tracer_provider):
        await trainer.train()

A span for the run, and under it one per rollout (scenario, worker slot, start version, fate,
the group's version, its age and seconds queued where it trained), per training call (step,
groups, their ages, the batch's tokens and token-weighted age, the version published), per
eval and per stall; events for publishes, cancellations and resizes. Built on the public
observer events only (`RunTracer` is the observer; `names` is the attribute vocabulary).
Works with any `TracerProvider` and exporter: OTLP to Jaeger, Tempo, Logfire, ...
"""

from __future__ import annotations

from . import names
from .traced import traced
from .tracer import RunTracer

__all__ = ["RunTracer", "names", "traced"]
