"""What a run is made of beyond the kernel: the extensions its settings ask for.

The one kernel module that names extension packages, and each is imported only where a
setting asks for it: a run with `resume=False`, `stall_seconds=None`, `admission="eager"` and
no `autotune=` loads none of them.
`tests/test_layers.py` holds this module to imports inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..config.settings import PipelineSettings
from ..plumbing.progress import ArtRecord, ProgressKeeper
from ..policy.admission import AdmissionPolicy, EagerAdmission
from ..stages import StageExtension


def progress_keeper(settings: PipelineSettings, model: Any) -> ProgressKeeper:
    """Where a run keeps its progress: with `resume=True` (the default) the durable
    exactly-once store, which also holds the directory for the run; else ART's own record."""
    if not settings.persistence.resume:
        return ArtRecord(model)
    from ..resume import DurableResume

    return DurableResume(model, fsync=settings.persistence.fsync_state)


def admission_policy(settings: PipelineSettings) -> AdmissionPolicy:
    """The run's admission policy: `admission=` by name, or the user's own object."""
    chosen = settings.freshness.admission
    if not isinstance(chosen, str):
        return chosen
    if chosen == "eager":
        return EagerAdmission()
    from ..admission import StalenessAwareAdmission

    return StalenessAwareAdmission(settings.rollouts_beyond_bound)


def tuned_start(autotune: Any, model: Any) -> Callable[[], dict[str, int | None]] | None:
    """The sizes an autotuned run starts from (None without autotuning)."""
    if getattr(autotune, "mode", "off") == "off":
        return None

    def start() -> dict[str, int | None]:
        from ..autotune import start_sizes

        return start_sizes(autotune, model)

    return start


def run_extensions(
    settings: PipelineSettings, autotune: Any, executor: Any, given: Sequence[StageExtension]
) -> list[StageExtension]:
    """The stage extensions of one run: the watchdog and the autotuner where the settings ask
    for them, then the user's own (`PipelineTrainer(..., extensions=[...])`)."""
    extensions: list[StageExtension] = []
    if settings.status.stall_seconds is not None:
        from ..watchdog import StallWatchdog

        extensions.append(
            StallWatchdog(settings.status.stall_seconds, settings.status.stall_action)
        )
    if getattr(autotune, "mode", "off") == "online":
        from ..autotune import Autotuner

        extensions.append(Autotuner(autotune, getattr(executor, "max_workers", None)))
    return [*extensions, *given]
