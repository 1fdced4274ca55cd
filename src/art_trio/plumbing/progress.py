"""A run's progress and how it is kept: ART's record, and the protocol a resume store fills.

`RunProgress` is what the stages keep of a run as ART's trainer keeps it: the step, the
scenarios consumed, the evals scheduled and done, ART 0.5.20's tallies. `ScenarioBook` is
which scenarios are settled for good; the kernel's keeps nothing, as ART's trainer, which
resumes at the count of scenarios it consumed. `ProgressKeeper` is where progress goes:
`ArtRecord` writes ART's own `_pipeline_trainer` record into the model's `state.json`, as
ART's trainer writes it. The durable exactly-once store (`art_trio.resume`) implements the
same protocol with a book of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("art_trio")

#: Key of the pipeline state inside ART's `state.json` (ART's, so each can read the other's).
PIPELINE_STATE_KEY = "_pipeline_trainer"


class ScenarioBook:
    """Which scenarios are settled for good. This one keeps nothing: a scenario is settled
    when consumed (ART's rule); `art_trio.resume` keeps each one's fate durably."""

    #: Every scenario below this index is settled (the source skips them on resume).
    watermark = 0
    #: Whether it keeps each scenario's fate; if not, a scenario taken is settled.
    keeps_fates = False

    def is_resolved(self, index: int) -> bool:
        return False

    def resolve(self, index: int) -> None:
        """One scenario's fate is final (trained, or discarded with a reason)."""

    def resolve_all(self, indices: Iterable[int]) -> None:
        """Several scenarios' fates are final."""

    def begin_batch(self, step: int, indices: Iterable[int]) -> None:
        """A batch goes to `backend.train` for `step` (recorded before the call)."""

    def commit_batch(self) -> None:
        """The batch announced by `begin_batch` trained."""

    def note_checkpoint(self, step: int, indices: Iterable[int], *, saved: bool) -> None:
        """Step `step` trained `indices`; `saved`: the backend was asked to checkpoint it."""


@dataclass(slots=True)
class RunProgress:
    """What a run keeps of its progress, changed only through its methods."""

    ledger: ScenarioBook = field(default_factory=ScenarioBook)
    total_scenarios_consumed: int = 0
    training_step: int | None = None
    last_eval_step: int = 0
    completed_eval_steps: set[int] = field(default_factory=set)
    #: Eval steps scheduled but not finished: a resumed run evaluates them again.
    pending_eval_steps: set[int] = field(default_factory=set)
    #: ART 0.5.20's running tallies (groups trained; completed groups discarded as stale or
    #: as zero variance), kept across resumes so `discarded/cum/*` continue where they were.
    accepted_trainable_groups: int = 0
    discarded_stale_groups: int = 0
    discarded_zero_variance_groups: int = 0
    #: The newest step the backend was asked to checkpoint (or every step, where the run
    #: keeps no checkpoints): what a restarted backend comes back at.
    saved_step: int | None = None

    #: How many of the source's first scenarios `check_scenario` must see.
    checked_scenarios = 0

    def at_step(self, step: int) -> None:
        """The run's model is at `step` (trained, resumed or settled against the backend)."""
        self.training_step = step

    def checkpoint_saved(self, step: int) -> None:
        """Step `step` trained and its checkpoint was asked for."""
        self.saved_step = step

    def schedule_eval(self, step: int) -> None:
        """`step` is to be evaluated (a resumed run does it first if this one does not)."""
        self.pending_eval_steps.add(step)
        self.last_eval_step = step

    def drop_eval(self, step: int) -> None:
        """`step`'s eval failed: done with, as in ART (not retried on resume)."""
        self.pending_eval_steps.discard(step)

    def complete_eval(self, step: int) -> None:
        self.pending_eval_steps.discard(step)
        self.completed_eval_steps.add(step)

    def scenario_taken(self, count: int = 1) -> None:
        """`count` scenarios were taken from the source (-1: one was given back)."""
        self.total_scenarios_consumed += count

    def set_tallies(self, accepted: int, stale: int, zero_variance: int) -> None:
        """ART 0.5.20's persisted tallies, carried forward from this run's counters."""
        self.accepted_trainable_groups = accepted
        self.discarded_stale_groups = stale
        self.discarded_zero_variance_groups = zero_variance

    def check_scenario(self, index: int, scenario: object) -> None:
        """Scenario `index` (< `checked_scenarios`) as the source yields it: a store that
        resumes by index refuses a source other than the one it recorded."""


class ProgressKeeper(Protocol):
    """Where a run's progress is kept. `train()` acquires it first (a store that must be the
    directory's only writer locks it there) and releases it last; the run opens it, records
    after each step (before `backend.train` once `begin_batch` announced the batch) and each
    eval, snapshots at the start and end, and closes it on every way out."""

    #: Where the progress is kept, for messages ("<dir>/state.json").
    where: str

    def acquire(self) -> None:
        """Before anything of a run happens (raise to refuse the run)."""
        ...

    def release(self) -> None:
        """After everything of a run ended."""
        ...

    def open(self, start_step: int, *, resume: bool) -> tuple[RunProgress, bool]:
        """The progress to continue from (settled against the backend's `start_step`), and
        whether it was resumed from a stored one."""
        ...

    def record(self, progress: RunProgress) -> None:
        """Persist what changed (cheap: once per step)."""
        ...

    def snapshot(self, progress: RunProgress) -> None:
        """Persist the whole progress."""
        ...

    def close(self) -> None: ...


class ArtRecord:
    """ART's own record: `_pipeline_trainer` in the model's `state.json` (its four fields),
    written at the start and end of a run and after each step whose checkpoint the backend
    was asked for. ART's trainer writes it after every step, so after a crash it skips the
    scenarios of steps the backend lost (it comes back at its last checkpoint); written with
    the checkpoint, the record's step is the backend's and those are rolled again (scenarios
    in flight still count as consumed, as in ART: exactly-once is `art_trio.resume`'s). It
    reads none: a run that resumes uses the durable store, which reads this record too."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.where = f"{model._get_output_dir()}/state.json"
        self._written: int | None = None

    def acquire(self) -> None:
        pass

    release = acquire

    def open(self, start_step: int, *, resume: bool) -> tuple[RunProgress, bool]:
        # A run that does not resume starts from the backend's step with nothing consumed.
        del resume
        return RunProgress(training_step=start_step, saved_step=start_step), False

    def record(self, progress: RunProgress) -> None:
        if progress.saved_step != self._written:
            self.snapshot(progress)

    def snapshot(self, progress: RunProgress) -> None:
        # This run's record replaces whatever record was there (ART's `merge_state` would
        # keep another store's fields beside it, as if they were this run's).
        try:
            state = self._model.read_state() or {}
        except ValueError as exc:  # torn by a crash during an earlier write (ART's is in place)
            logger.warning("%s is unreadable (%s); rewriting it with this run's record",
                           self.where, exc)
            state = {}
        state[PIPELINE_STATE_KEY] = {
            "scenario_offset": progress.total_scenarios_consumed,
            "total_scenarios_consumed": progress.total_scenarios_consumed,
            "training_step": progress.training_step,
            "last_eval_step": progress.last_eval_step,
            # Read by a store that keeps a journal beside this file: its journal is older.
            "journal": False,
        }
        self._model.overwrite_state(state)
        self._written = progress.saved_step

    def close(self) -> None:
        pass
