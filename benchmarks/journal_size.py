"""Journal record, journal and snapshot sizes after N steps with an eval every step.

    PYTHONPATH=<tree>/src python benchmarks/journal_size.py 2000
    PYTHONPATH=<tree>/src python benchmarks/journal_size.py 800 backlog
    PYTHONPATH=<tree>/src python benchmarks/journal_size.py 2000 unsaved

A state store appends one record per step (two scenarios resolved, the next batch pending,
one more completed eval), as a run with `eval_every_n_steps=1` does, with periodic snapshots
turned off so the whole journal stays; then one snapshot is written. With `backlog`, evals
are slower than steps (issue 32): one is scheduled every step and one completes every other
step, so the pending evals grow to steps / 2. With `unsaved`, no step is checkpointed (no
evals) and batches are 32 scenarios, so up to 64 trained batches stay unsaved. Runs against
whichever art_trio is on the path (a tree before issue 25 adds to the set directly), so two
revisions compare like with like.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from art_trio.resume import files
from art_trio.resume import store as ledger_store
from art_trio.resume.state import PipelineState
from art_trio.resume.store import StateStore


def main(steps: int, backlog: bool = False, unsaved: bool = False) -> None:
    ledger_store.SNAPSHOT_EVERY = 10**9
    directory = Path(tempfile.mkdtemp())
    store, state = StateStore(directory), PipelineState()
    store.write(state)
    for step in range(steps):
        state.ledger.resolve_all([2 * step, 2 * step + 1])
        state.ledger.begin_batch(step + 1, [2 * step + 2, 2 * step + 3])
        state.training_step = step
        if unsaved:
            batch = list(range(32 * step, 32 * (step + 1)))
            state.ledger.note_checkpoint(step, batch, saved=False)
        elif backlog:
            state.pending_eval_steps.add(step)
            if step % 2:
                oldest = min(state.pending_eval_steps - state.completed_eval_steps)
                state.pending_eval_steps.discard(oldest)
                state.complete_eval(oldest)
        elif hasattr(state, "complete_eval"):
            state.complete_eval(step)
        else:  # before issue 25
            state.completed_eval_steps.add(step)
        store.append(state)
    store.close()
    records = (directory / files.JOURNAL_FILE).read_bytes().splitlines()
    store.write(state)
    snapshot = (directory / files.SIDECAR_FILE).stat().st_size
    backlog_now = len(state.pending_eval_steps - state.completed_eval_steps)
    print(
        f"steps={steps} pending evals={backlog_now} evals={len(state.completed_eval_steps)} "
        f"first record={len(records[0])} B, last record={len(records[-1])} B, "
        f"journal={sum(map(len, records))} B, snapshot={snapshot} B"
    )


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 2000,
        backlog="backlog" in sys.argv[2:],
        unsaved="unsaved" in sys.argv[2:],
    )
