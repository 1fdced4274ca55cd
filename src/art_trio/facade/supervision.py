"""Supervision of a run's stages: who failed first, and what `train()` raises.

The stages run in one task group (trainer.py opens it); each runs inside `run_stage`, which
labels an exception leaving it with the stage's name and records it as the run's first error
unless another came first, so an observer raising while the run winds down never replaces
it. `raise_failure` turns the task group's exception group into what the caller gets (a
callback's KeyboardInterrupt or SystemExit as itself), and `close_run` saves the resume state
on every way out without letting a saving error hide the failure that ended the run.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import anyio

from ..messages.errors import _BaseExceptionEscaped
from ..run import PipelineRun
from ..stages import Stage

logger = logging.getLogger("art_trio")


async def run_stage(
    run: PipelineRun, name: str, fn: Callable[..., Awaitable[None]], *args: Any, **kwargs: Any
) -> None:
    """Run one stage; an exception leaving it is labelled with the stage's name, and is the
    run's first error unless another came first (`Observers.note_failure`).

    A stage's own task group (the rollout workers) wraps a worker's exception in a group; a
    group holding one exception is unwrapped, so the caller gets one group, not two nested.
    """
    try:
        try:
            await fn(*args, **kwargs)
        except ExceptionGroup as group:
            found = list(leaves(group))
            if len(found) != 1:
                raise
            raise found[0] from None
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

    A callback's KeyboardInterrupt or SystemExit travelled through the stages as
    `_BaseExceptionEscaped` (so the run ended cleanly); the caller gets the original, with the
    stage's note, as if the run had not been in between.
    """
    if not isinstance(failure, BaseExceptionGroup):
        raise failure
    for leaf in leaves(failure):
        original = leaf.original if isinstance(leaf, _BaseExceptionEscaped) else leaf
        if isinstance(original, (KeyboardInterrupt, SystemExit)):
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
