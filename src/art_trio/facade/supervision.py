"""Supervision of a run's stages: who failed first, and what `train()` raises.

`run_stages` runs the stages (and the extensions') in one task group; each runs inside
`run_stage`, which labels an exception leaving it with the stage's name and records it as the
run's first error unless another came first, so an observer raising while the run winds down
never replaces it. `bridged` opens the bridge a run works in and turns what failed into what
the caller gets (a callback's KeyboardInterrupt or SystemExit as itself), and `close_run`
saves the resume state on every way out without letting a saving error hide the failure that
ended the run.
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NoReturn

import anyio
from anyio.abc import TaskStatus

from ..messages.errors import _BaseExceptionEscaped
from ..messages.events import RunStatistics
from ..plumbing.bridge.calls import Bridge, open_bridge
from ..plumbing.hooks import backend_hook
from ..run import PipelineRun
from ..stages import RunView, Stage, StageExtension
from ..stages.control import ControlStage
from ..stages.evaluation import EvalStage
from ..stages.rollout import RolloutStage
from ..stages.status import StatusStage
from ..stages.training import TrainingStage

logger = logging.getLogger("art_trio")


async def run_stages(
    run: PipelineRun,
    extensions: Sequence[StageExtension],
    *,
    statistics: Callable[[], RunStatistics],
    resize: Callable[..., RunStatistics],
    handle_signals: bool,
    task_status: TaskStatus[None],
) -> None:
    """Run the stages of `run` and those of its `extensions` (each given a `RunView`, with
    the trainer's `statistics` and `resize`) in one task group, until all have ended.

    A user observer's error that ended the run is raised first (in a group, as a stage's
    error reaches the caller), with what the winding-down stages raised after it in a note.
    """
    rollouts, training = RolloutStage(run), TrainingStage(run)
    control = ControlStage(run.stop, handle_signals=handle_signals)
    view = RunView(
        model=run.model, settings=lambda: run.settings, counters=run.counters,
        gate=run.gate, calls=run.calls, stop=run.stop, bridge=run.bridge,
        status=run.status, clock=run.now, emit=run.emit, observe=run.observers.add,
        statistics=statistics, resize=resize, rollouts_in_flight=rollouts.in_flight,
        workers_running=lambda: len(run.workers), ready=lambda: len(training.ready),
        queue=run.groups.statistics,
    )
    # An extension's stage ends with the run's own stages at the latest: one that never
    # returns must not keep train() from returning.
    extra = [s for s in (ext.stage(view) for ext in extensions) if s is not None]
    stages: list[Stage] = [rollouts, training, EvalStage(run), StatusStage(run)]
    stages += [BoundedStage(s, run.stop.finished) for s in extra]
    try:
        with run.stop.run_scope as run_scope:
            async with anyio.create_task_group() as tg:
                run.eval_leases.attach(tg)
                # Signals first: the other stages start once a SIGINT is a stop.
                await tg.start(
                    run_stage, run, control.name, control, name=f"art_trio {control.name} stage"
                )
                for stage in stages:
                    # Named for the stall watchdog's task tree ("art_trio training stage").
                    tg.start_soon(
                        run_stage, run, stage.name, stage, name=f"art_trio {stage.name} stage"
                    )
                task_status.started()
        await _finalize(run, cancelled=run_scope.cancel_called)
    except Exception as exc:
        if run.observers.raised is None:
            raise
        run.observers.raised.add_note(f"while the run ended, a stage raised {exc!r}")
    raise_observer_error(run)


async def _finalize(run: PipelineRun, *, cancelled: bool) -> None:
    """ART 0.5.20+'s end of a training session (the Megatron backend's), once every stage
    ended without an error and this run trained a step; not after a forced stop. Its metrics
    feed only ART's autotuner attachments, which art_trio has not."""
    finalize = backend_hook(run.backend, "finalize_training_session")
    if finalize is not None and run.counters.steps and not cancelled:
        await run.bridge.call(finalize, run.model)


def raise_observer_error(run: PipelineRun) -> None:
    """Raise the user observer's error that ended the run (the stages ended as at a forced
    stop): in a group, as a stage's error reaches the caller."""
    if run.observers.raised is not None:
        raise ExceptionGroup("an observer of the run raised", [run.observers.raised])


@asynccontextmanager
async def bridged() -> AsyncIterator[Bridge]:
    """The bridge a `train()` call works in; what fails inside is raised once it is closed
    (a trio-asyncio loop opened here would otherwise wrap it, the stages' group too, in
    groups of its own), as `raise_failure` says."""
    failure: BaseException | None = None
    try:
        async with open_bridge() as bridge:
            try:
                yield bridge
            except (Exception, BaseExceptionGroup) as exc:
                failure = exc
    except BaseExceptionGroup as group:
        unwrap_escaped(group)
    if failure is not None:
        raise_failure(failure)


async def run_stage(
    run: PipelineRun, name: str, fn: Callable[..., Awaitable[None]], *args: Any, **kwargs: Any
) -> None:
    """Run one stage; an exception leaving it is labelled with the stage's name, and is the
    run's first error unless another came first (`Observers.note_failure`).

    A stage's own task group (the rollout workers) wraps a worker's exception in a group; a
    group holding one exception is unwrapped, so the caller gets one group, not two nested.
    Workers that failed alike (a rollout_fn that can never work fails in every one of them
    at once) are told once: the first of each same error is kept.
    """
    try:
        try:
            await fn(*args, **kwargs)
        except ExceptionGroup as group:
            found = _distinct(leaves(group))
            if len(found) == 1:
                raise found[0] from None
            raise group.derive(found) from None
    except Exception as exc:
        run.observers.note_failure(exc)
        exc.add_note(f"raised in art_trio's {name} stage")
        if isinstance(exc, _BaseExceptionEscaped):
            logger.warning("Pipeline stage ended: %s: %s; stopping the run.", name, exc)
        else:
            logger.error("Pipeline stage failed: %s: %s: %s", name, type(exc).__name__, exc)
        raise


class BoundedStage:
    """`stage`, cancelled once `finished` is set (the run's own stages have all ended) if it
    has not returned by then: an extension's stage cannot keep a run from ending."""

    def __init__(self, stage: Stage, finished: anyio.Event) -> None:
        self.name, self._stage, self._finished = stage.name, stage, finished

    async def __call__(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cancel_when_finished, tg.cancel_scope)
            await self._stage()
            tg.cancel_scope.cancel()

    async def _cancel_when_finished(self, scope: anyio.CancelScope) -> None:
        await self._finished.wait()
        scope.cancel()


def raise_failure(failure: BaseException) -> NoReturn:
    """Raise the stages' failure: KeyboardInterrupt or SystemExit as themselves, else as is.

    A callback's KeyboardInterrupt or SystemExit (or other BaseException) travelled through
    the stages as `_BaseExceptionEscaped` (so the run ended cleanly); the caller gets the
    original, with the stage's note, as if the run had not been in between.
    """
    if not isinstance(failure, BaseExceptionGroup):
        raise failure
    for leaf in leaves(failure):
        original = leaf.original if isinstance(leaf, _BaseExceptionEscaped) else leaf
        if original is not leaf or isinstance(original, (KeyboardInterrupt, SystemExit)):
            for note in [*getattr(leaf, "__notes__", []), *getattr(failure, "__notes__", [])]:
                if note not in getattr(original, "__notes__", []):
                    original.add_note(note)
            raise original from None
    raise failure


def unwrap_escaped(group: BaseExceptionGroup[Any]) -> NoReturn:
    """What escaped the run bare (trio's KeyboardInterrupt, SystemExit) comes out of the
    trio-asyncio loop wrapped twice: raise the exception itself, else the group."""
    found = list(leaves(group))
    if len(found) == 1 and isinstance(found[0], (KeyboardInterrupt, SystemExit)):
        raise found[0] from None
    raise group


def _distinct(errors: Iterable[BaseException]) -> list[Exception]:
    """The errors of an `ExceptionGroup` (Exceptions all), each kind and message once (the
    first kept)."""
    seen: dict[tuple[type, str], Exception] = {}
    for error in errors:
        assert isinstance(error, Exception)
        seen.setdefault((type(error), str(error)), error)
    return list(seen.values())


@contextmanager
def lone_error_raised() -> Iterator[None]:
    """A task group's one exception raised as itself: the group around it says nothing."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def leaves(group: BaseExceptionGroup[Any]) -> Iterator[BaseException]:
    """The exceptions in a (nested) exception group, depth first."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from leaves(exc)
        else:
            yield exc


def close_run(run: PipelineRun, failure: BaseException | None) -> None:
    """Save the state and close its files, whatever happened.

    The first error wins: if saving fails after `failure`, the caller still gets `failure`,
    with the saving error in a note; without a failure, the saving error is raised (the
    run's state on disk is then the last journal record).
    """
    counters = run.counters
    if counters.steps == 0 and 0 < counters.empty_groups == counters.zero_variance:
        warnings.warn(
            f"no step was trained: all {counters.empty_groups} groups rollout_fn returned "
            "had no trajectories. Check that rollout_fn returns its trajectories.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif failure is None and counters.steps == 0 and 0 < counters.errored == counters.taken:
        # Below the failure streak's stop, a run whose every rollout failed returned like
        # one that trained: the per-rollout lines scroll by and nothing says it all failed.
        warnings.warn(
            f"no step was trained: all {counters.errored} scenarios taken ended errored "
            "(rollout_fn raised, or returned no trainable group: each one's reason is logged "
            "above). Check rollout_fn on one scenario before training again.",
            RuntimeWarning,
            stacklevel=3,
        )
    try:
        run.snapshot()
    except Exception as exc:
        if failure is None:
            raise
        failure.add_note(
            f"art_trio could not save the final resume state after this failure: "
            f"{type(exc).__name__}: {exc}. The last journal record on disk is the resume "
            "point: a resumed run settles the batch in flight against the backend's step."
        )
        warnings.warn(
            f"could not save the resume state after a failure: {exc!r}",
            RuntimeWarning,
            stacklevel=3,
        )
    finally:
        run.keeper.close()


#: Objects the interpreter itself froze at start-up. CPython 3.12 reports a few hundred
#: (static tuples; 3.11 and 3.13 report none); they count as nobody's freeze, so a run may
#: freeze and unfreeze over them. Elsewhere any frozen object is someone's to keep.
_FROZEN_BY_INTERPRETER = gc.get_freeze_count() if sys.version_info[:2] == (3, 12) else 0


@contextmanager
def long_lived_objects_frozen() -> Iterator[None]:
    """Keep the cyclic garbage collector off what existed before the run, for the run.

    A run allocates a few objects per rollout (an asyncio task per bridged call, a group, its
    trajectories); each full collection then walks everything the process holds, ART's
    imports included (about 250k objects, ~0.18 s a pass). Measured with the kernel split off
    (`art-trio bench --workloads overhead-b32`, seeds 0-1, twice): the bridged path does
    6,581-6,985 groups/s with the freeze and 5,749-6,002 without (143-153 against 167-174 CPU
    us a group); anyio on asyncio is the same either way. Objects from before `train()` are
    modules, the model and the user's own: frozen for the run (freed by reference counting
    as ever; only cyclic garbage among them waits) and handed back to the collector after.
    Skipped if the host froze objects itself (it may rely on that: `gc.unfreeze()` releases
    every frozen object). On Python 3.12 the interpreter's own start-up freeze is not the
    host's: the run's unfreeze hands those few hundred tuples to the collector as well.
    """
    if gc.get_freeze_count() > _FROZEN_BY_INTERPRETER or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
