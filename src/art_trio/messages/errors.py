"""Every exception art_trio's core raises, in one place, on one base: `ArtTrioError`.

`except art_trio.ArtTrioError` catches whatever the trainer itself raises; each error also
keeps the builtin base callers already catch (`StateFileError` is a `ValueError`,
`RunLockedError` a `RuntimeError`, `LoopUnresponsive` a `TimeoutError`, ...). Every public
one is exported from `art_trio`.

Not here, on purpose:
- the extras' errors live with their extra and share the base: `art_trio.testing`'s
  `PipelineCheckFailed` (an `AssertionError`, whose `case` is the harness's type) and
  `art_trio.cpu`'s `ModelSourceError`;
- the doubles' planned failures (`art_trio.sim`'s `RolloutFailed`, the harness's
  `PlannedRolloutError`) stand for a user's rollout raising, so they are deliberately not
  art_trio errors; the demo server's HTTP errors are its responses.

The three private classes at the end are signals between art_trio's own modules (a closed
gate, a carried KeyboardInterrupt, a loop that ended); none of them ever reaches a caller.

This module is the bottom layer: it imports nothing from art_trio. (The stall watchdog's
`PipelineStalled` is its own: `art_trio.watchdog`.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path


class ArtTrioError(Exception):
    """The base of every error art_trio raises (each also keeps its builtin base)."""


# --- the model directory and its resume state ----------------------------------------------


class RunLockedError(ArtTrioError, RuntimeError):
    """Another run holds the model directory: this one must not read or write its state."""

    def __init__(self, directory: Path, holder: str) -> None:
        self.directory = directory
        self.holder = holder
        super().__init__(
            f"another art_trio run is training in {directory} ({holder}). Only one run may "
            "use a model directory at a time: two would train the same scenarios twice. Wait "
            "for it to end or stop it (SIGINT/SIGTERM, or request_stop()); to run both, give "
            "this one another model name or project. The lock is released by the kernel when "
            "that process exits, even on kill -9, so there is never a stale lock to delete."
        )


class ModelDirectoryError(ArtTrioError, OSError):
    """The model directory cannot hold a run: not a directory, not writable, no locks, or
    deleted while the run used it. Carries the errno; `filename` is the directory."""

    def __str__(self) -> str:
        # The message names the directory and says what to do; OSError's own form would
        # append "[Errno N]" before it and ": '<directory>'" after its last sentence.
        return str(self.strerror)


class RunLockLostError(ModelDirectoryError):
    """This run's lock on its model directory was lost while it ran (its descriptor closed or
    unlocked by code in this process): another run may have taken the directory meanwhile,
    so this run stops without writing its state over that run's."""


class StateFileError(ArtTrioError, ValueError):
    """A resume-state file is malformed, hand-edited, or written by another run."""


class ForeignStateError(StateFileError):
    """The stored state belongs to another run (model, project or scenario source)."""


class StateWriteError(ArtTrioError, OSError):
    """A resume-state write failed or was short; nothing after it may assume it happened."""


class ModelDirectoryLostError(StateWriteError, ModelDirectoryError):
    """The model directory, or art_trio's files in it, vanished or were replaced mid-run."""


class ProfileError(ArtTrioError, ValueError):
    """A saved autotune profile that cannot be used: names the file, the field and the fix."""


# --- rollouts, executors and user callbacks -------------------------------------------------


class RolloutRejected(ArtTrioError):
    """A rollout returned something the trainer cannot train."""


class RolloutsKeepFailing(ArtTrioError, RuntimeError):
    """Too many rollouts failed in a row: the rollout code or what it calls is broken."""


class RolloutLost(ArtTrioError):
    """The rollout's worker (process or node) died; the scenario was not rolled out. The trainer
    gives the scenario back to be rolled again (not an error, not resolved)."""


class ExecutorUnavailable(ArtTrioError, RuntimeError):
    """The executor cannot run rollouts at all (no worker it could place or reach in time):
    not the scenario's failure. The run ends with this error; the scenario stays unresolved
    (rolled again on resume), never counted as errored or stale."""


class ScenarioSourceClosed(ArtTrioError, RuntimeError):
    """`train()` was called again on a trainer whose one-shot scenario source was closed
    before its end (an async generator the last call's asyncio loop finalized)."""


class CallbackNotAwaitable(ArtTrioError, TypeError):
    """A user callback returned something that cannot be awaited: the run cannot go on."""


class AsyncioTaskCancelled(ArtTrioError, RuntimeError):
    """Asyncio code cancelled itself while the trainer was not being cancelled."""


# --- policy versions, training and evaluation -----------------------------------------------


class FuturePolicyError(ArtTrioError, RuntimeError):
    """A trajectory claims tokens from a policy version the trainer has not published yet.

    A replayed trajectory, a reset version counter or a bug in the rollout: its age cannot be
    known, so it cannot be trained under either staleness bound. ART 0.5.23's trainer stops
    the run on it ("Trajectory tokens came from a future policy"); so does art_trio, on
    every ART line, with the same words first.
    """


class BackendStepError(ArtTrioError, RuntimeError):
    """`backend.train` reported a step other than the one after the step it trained from."""


class EvalProvenanceError(ArtTrioError, RuntimeError):
    """An eval's tokens do not all come from the policy of the step it evaluated."""


# --- calls from other threads ---------------------------------------------------------------


class LoopUnresponsive(ArtTrioError, TimeoutError):
    """The trainer's event loop did not run a call from another thread in time."""


# --- private: signals between art_trio's modules, never raised to a caller -----------------


class _GateClosed(Exception):
    """Raised by `PolicyGate.admit` once the run stops admitting rollouts."""


class _BaseExceptionEscaped(Exception):
    """A KeyboardInterrupt or SystemExit raised by a callback, carried as an ordinary exception.

    The stages treat it as a failure (so everything is cancelled and the state is saved);
    `train()` then re-raises `original` itself.
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__} raised in a callback: {original}")
        self.original = original


def self_cancelled(fn: object) -> AsyncioTaskCancelled:
    """The error for asyncio code `fn` that raised asyncio.CancelledError of its own."""
    return AsyncioTaskCancelled(
        f"{getattr(fn, '__qualname__', fn)!s} raised asyncio.CancelledError while the trainer "
        "was not cancelling it (the code cancelled itself)"
    )


def sync_callback_error(raised: BaseException, fn: object) -> Exception:
    """What a synchronous user callback's exception (an observer, a plain iterator's `next`)
    travels through the stages as. No cancellation of the trainer's reaches code that does
    not await, so whatever it raises is its own: an Exception as itself; KeyboardInterrupt and
    SystemExit (and any other BaseException) as `_BaseExceptionEscaped`, since raised on in an
    asyncio task they would end the event loop (`train()` raises the original); and
    asyncio.CancelledError as `AsyncioTaskCancelled`, which would otherwise read as the run
    being cancelled and end it silently."""
    if isinstance(raised, Exception):
        return raised
    if isinstance(raised, asyncio.CancelledError):
        return self_cancelled(fn)
    return _BaseExceptionEscaped(raised)


class _LoopClosed(RuntimeError):
    """The trainer's event loop ended before it could run a call from another thread."""


__all__ = [
    "ArtTrioError",
    "AsyncioTaskCancelled",
    "BackendStepError",
    "CallbackNotAwaitable",
    "EvalProvenanceError",
    "ExecutorUnavailable",
    "ForeignStateError",
    "FuturePolicyError",
    "LoopUnresponsive",
    "ModelDirectoryError",
    "ModelDirectoryLostError",
    "ProfileError",
    "RolloutLost",
    "RolloutRejected",
    "RolloutsKeepFailing",
    "ScenarioSourceClosed",
    "RunLockedError",
    "RunLockLostError",
    "StateFileError",
    "StateWriteError",
]
