"""A run's start-up: the progress opened against the backend's step, the run built.

`open_run` is the one place a `train()` call turns its trainer's configuration into a live
`PipelineRun`: it asks the backend for its step, opens the progress keeper there (a durable
store settles a batch left pending by a run that died inside `backend.train`), queues the
evals a stop interrupted (and the start-of-run eval), and writes the progress once. Nothing
is written before the run is built, so a stop during start-up (a cancellation of this call)
leaves the state on disk as it was.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..config.settings import PipelineSettings
from ..messages.events import Observers
from ..observation.fates import CounterFold
from ..observation.status import StatusReporter
from ..plumbing.bridge.calls import Bridge
from ..plumbing.executor import RolloutExecutor
from ..plumbing.progress import ProgressKeeper, RunProgress
from ..plumbing.source import ScenarioSource
from ..policy.admission import AdmissionPolicy
from ..run import PipelineRun

logger = logging.getLogger("art_trio")


async def open_run(
    bridge: Bridge,
    *,
    model: Any,
    backend: Any,
    settings: PipelineSettings,
    scenarios: Any,
    keeper: ProgressKeeper,
    admission: AdmissionPolicy,
    rollout_fn: Any,
    eval_fn: Any,
    config: Any,
    executor: RolloutExecutor | None,
    observers: Observers,
    score_references: tuple[float | None, float | None],
) -> tuple[PipelineRun, MemoryObjectSendStream[int], MemoryObjectReceiveStream[int]]:
    """The run, and the eval channel with the evals it starts with already queued."""
    start_step = int(await bridge.call(model.get_step))
    state, resumed = keeper.open(start_step, resume=settings.persistence.resume)
    source: ScenarioSource[Any] = ScenarioSource(scenarios, state, bridge)
    fold = CounterFold()
    status = StatusReporter(
        get_scenario_offset=lambda: source.position,
        log_interval_seconds=settings.status.log_interval_seconds,
        status_ewa_alpha=settings.status.status_ewa_alpha,
        total_scenarios=settings.status.total_scenarios,
        num_workers=settings.sizes.num_rollout_workers,
        clock=anyio.current_time,
        counters=fold,
    )
    run = PipelineRun(
        model=model,
        backend=backend,
        settings=settings,
        bridge=bridge,
        state=state,
        keeper=keeper,
        status=status,
        fold=fold,
        start_step=start_step,
        source=source,
        admission=admission,
        rollout_fn=rollout_fn,
        eval_fn=eval_fn,
        config=config,
        executor=executor,
        observers=observers,
        score_references=score_references,
    )
    # The resolved prefix is skipped by the rollout stage's first take, where a stop
    # reaches it (a slow source can take long to skip).
    eval_send, eval_receive = anyio.create_memory_object_stream[int](math.inf)
    if eval_fn is not None:
        _queue_first_evals(
            state, eval_send, start_step,
            at_start=settings.evaluation.eval_at_start and (not resumed or start_step == 0),
        )
    run.snapshot()
    return run, eval_send, eval_receive


def _queue_first_evals(
    state: RunProgress, eval_send: MemoryObjectSendStream[int], start_step: int,
    *, at_start: bool,
) -> None:
    """Evals a stop interrupted, then the start-of-run eval."""
    for step in sorted(state.pending_eval_steps - state.completed_eval_steps):
        if step <= start_step:
            eval_send.send_nowait(step)
    # The start step of a fresh run (or a run at step 0), once: a resumed run re-ran its
    # interrupted evals above and keeps its every-n schedule (ART 0.5.18 instead evaluates
    # whatever step it resumes at, and restarts the schedule from there).
    if at_start and start_step not in state.pending_eval_steps | state.completed_eval_steps:
        state.schedule_eval(start_step)
        eval_send.send_nowait(start_step)
