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
(`StateStore`: reading and writing one directory's state).
"""

from __future__ import annotations

from ...messages.errors import (
    ForeignStateError,
    ModelDirectoryLostError,
    StateFileError,
    StateWriteError,
)
from .files import JOURNAL_FILE, SIDECAR_FILE
from .scenarios import PendingBatch, ScenarioLedger, scenario_digest
from .state import (
    PIPELINE_STATE_KEY,
    SCENARIO_DIGESTS,
    STATE_FORMAT,
    TALLY_FIELDS,
    PipelineState,
    eval_runs,
)
from .store import StateStore

__all__ = [
    "JOURNAL_FILE",
    "PIPELINE_STATE_KEY",
    "SCENARIO_DIGESTS",
    "STATE_FORMAT",
    "TALLY_FIELDS",
    "ModelDirectoryLostError",
    "SIDECAR_FILE",
    "ForeignStateError",
    "PendingBatch",
    "PipelineState",
    "ScenarioLedger",
    "StateFileError",
    "StateStore",
    "StateWriteError",
    "eval_runs",
    "scenario_digest",
]
