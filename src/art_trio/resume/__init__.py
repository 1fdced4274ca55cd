"""Resume state: which scenarios are resolved, persisted so a crash neither skips nor repeats.

The reference persists how many scenarios it *took*; a crash then skips every scenario that
was in flight, queued or in the batch being trained. art_trio keeps a ledger instead:

- a low watermark (`scenario_offset`, the reference's key) below which every scenario index
  is resolved: trained, or discarded with a reason (stale, zero variance, errored);
- the resolved indices above it;
- the batch handed to `backend.train`, written *before* the call. On resume a pending batch
  whose step the backend reports as done counts as trained; otherwise its scenarios are
  rolled again.

Scenario indices are positions in the scenario source, so a resumed run must be given the
same source in the same order (as with the reference).

Persisting is a journal plus snapshots, so a step costs one small append, not a file rewrite:
each step appends a record (what was resolved since the last one, the pending batch, the small
fields) to `art_trio_journal.jsonl` before `backend.train` is called; every few hundred
records, and at the start and end of `train()`, the whole state is written atomically
(temporary file, fsync, rename) to `art_trio_state.json` and mirrored into ART's `state.json`,
and the journal starts over. Reading takes the snapshot and replays the newer records; a
record torn by a kill is the last line, and is ignored (the train call it announced never
started).

What a write guarantees (issue 19):
- complete or absent: a journal record is written in full or the journal is cut back to the
  record before it, and the caller gets a `StateWriteError` (an OSError carrying the errno,
  ENOSPC for a full disk) instead of a short count; the trainer calls `backend.train` only
  after the batch's record is on disk, so a failed record stops the run before the batch
  trains. Snapshots are temporary file + rename, so a failed one leaves the previous one.
- one generation: every snapshot draws a new `journal_epoch`, and every record carries the
  epoch of the snapshot it follows. Replay takes only records of the snapshot's epoch, so a
  crash between a snapshot (`resume=False`'s fresh one, or a periodic one) and the journal's
  reset never replays another generation's records onto it.
- incremental (issue 25): a record carries the evals completed since the previous one
  (`evals_completed`), the snapshot the completed evals as arithmetic runs
  (`completed_eval_runs`), so neither grows with the number of evals; only the mirror in
  `state.json` keeps ART's whole `completed_eval_steps` list. Files of the previous format
  (whole lists in every record and snapshot) are still read.
- validated: a malformed, hand-edited or foreign file raises `StateFileError` naming the
  file, what is wrong and what to do; a state whose recorded model, project or first
  scenarios differ from this run's is refused (`ForeignStateError`).

The package's modules, one concern each: `scenarios` (the in-memory ledger), `state` (the
persisted state and its JSON forms), `files` (the files on disk and their writes), `store`
(`StateStore`: reading and writing one directory's state), `lock` (one run per directory).
`DurableResume` is the kernel's `ProgressKeeper` over them, which the trainer composes when
`resume=True` (the default).
"""

from __future__ import annotations

import logging
from typing import Any

from ..plumbing.progress import RunProgress
from .lock import RunLock
from .state import PipelineState
from .store import StateStore

__all__ = ["DurableResume", "PipelineState", "RunLock", "StateStore"]

logger = logging.getLogger("art_trio")


class DurableResume:
    """Exactly-once resume: a `ProgressKeeper` whose progress has a durable ledger, held by
    one run at a time (`RunLock`, from `acquire` to `release`)."""

    def __init__(self, model: Any, *, fsync: bool = False) -> None:
        directory = model._get_output_dir()
        self._lock = RunLock(directory)
        self.store = StateStore(
            directory, fsync=fsync, identity={"model": model.name, "project": model.project},
            lock=self._lock,
        )
        self.where = str(self.store.sidecar_path)

    def acquire(self) -> None:
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def open(self, start_step: int, *, resume: bool) -> tuple[RunProgress, bool]:
        stored = self.store.read() if resume else None
        state = stored or PipelineState()
        state.state_file = self.where
        _settle_with_backend(state, start_step)
        return state, stored is not None

    def record(self, progress: RunProgress) -> None:
        assert isinstance(progress, PipelineState)
        self.store.append(progress)

    def snapshot(self, progress: RunProgress) -> None:
        assert isinstance(progress, PipelineState)
        self.store.write(progress)

    def close(self) -> None:
        self.store.close()


def _settle_with_backend(state: PipelineState, start_step: int) -> None:
    """Settle a pending batch, and the steps trained without a checkpoint, against the
    backend's step; the backend's step wins."""
    pending = state.ledger.pending
    if state.ledger.settle_pending(start_step) and pending is not None:
        state.at_step(pending.step)
    lost = state.ledger.roll_back_unsaved(start_step)
    if state.training_step is not None and state.training_step != start_step:
        logger.warning(
            "the pipeline state was saved at step %d but the backend is at step %d "
            "(its last checkpoint); continuing from the backend's step.%s",
            state.training_step,
            start_step,
            f" The {len(lost)} scenarios trained after it are rolled again." if lost else "",
        )
    state.at_step(start_step)
