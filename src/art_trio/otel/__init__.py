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

try:
    import opentelemetry.trace  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "art_trio.otel needs opentelemetry-api: pip install 'art-trio[otel]'"
    ) from exc

from . import names  # noqa: E402
from .traced import traced  # noqa: E402
from .tracer import RunTracer  # noqa: E402

__all__ = ["RunTracer", "names", "traced"]
