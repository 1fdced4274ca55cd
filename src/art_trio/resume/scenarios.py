"""Which scenarios are resolved: the in-memory ledger (`ScenarioLedger`: a low watermark,
the resolved indices above it, the batch handed to `backend.train`) and the fingerprint that
ties a stored state to its scenario source (`scenario_digest`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..plumbing.progress import ScenarioBook


def scenario_digest(scenario: object) -> str | None:
    """A stable fingerprint of one scenario, or None if it has no stable JSON form.

    Dicts, lists, strings and numbers, pydantic models and dataclasses of them have one; for
    anything else (objects whose repr holds an address) the check is skipped, never guessed.
    A fingerprint never ends the run: whatever computing it raises means "no stable form".
    """
    data: object = scenario
    try:
        # Looked up on the type, not the instance: an attribute-dict (`__getattr__ =
        # dict.__getitem__`, a common idiom) raises KeyError for a missing attribute, which
        # getattr's default does not catch; and a dict key named `model_dump` is not a method.
        dump = getattr(type(scenario), "model_dump", None)
        if callable(dump):
            data = dump(scenario, mode="json")
        elif dataclasses.is_dataclass(scenario) and not isinstance(scenario, type):
            data = dataclasses.asdict(scenario)
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    except Exception:  # noqa: BLE001  (a user's model_dump, a cycle, keys sort cannot order)
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Per state file, the fingerprint each of its run's first scenarios had when a source first
#: yielded it, with the object itself (so its id stays its own). A rollout may annotate its
#: scenario (`scenario["seen"] = True`): a resume in the same program given the same objects
#: must be compared by what they were when yielded, not by what rollouts made of them.
_FIRST_SEEN: dict[str, dict[int, tuple[object, str | None]]] = {}
#: Entries kept per state file: the first scenarios of the last few sources given for it.
_FIRST_SEEN_KEPT = 32


def first_seen_digest(state_file: str, item: object) -> str | None:
    """The item's fingerprint as first yielded for this state file (see `_FIRST_SEEN`)."""
    seen = _FIRST_SEEN.setdefault(state_file, {})
    known = seen.pop(id(item), None)
    if known is not None and known[0] is item:
        digest = known[1]
    else:
        digest = scenario_digest(item)
    seen[id(item)] = (item, digest)  # re-inserted last: the oldest entries go first
    while len(seen) > _FIRST_SEEN_KEPT:
        del seen[next(iter(seen))]
    return digest


#: The most unsaved steps the ledger remembers (see `ScenarioLedger.note_checkpoint`).
MAX_UNSAVED_STEPS = 64


@dataclass(slots=True)
class PendingBatch:
    """A batch handed to `backend.train` whose outcome was not yet recorded."""

    step: int
    scenario_indices: list[int]


@dataclass(slots=True)
class ScenarioLedger(ScenarioBook):
    """Resolution of scenario indices, compacted under a low watermark."""

    watermark: int = 0
    keeps_fates = True
    resolved_above: set[int] = field(default_factory=set)
    pending: PendingBatch | None = None
    #: Batches trained at steps the backend was not asked to checkpoint (ART's trainers ask
    #: only at eval steps), newest last. A backend that honours that and restarts comes back
    #: at its last checkpoint: on resume, these batches' scenarios are rolled again.
    unsaved: list[PendingBatch] = field(default_factory=list)
    #: Indices resolved since the last journal record (what the next record must carry).
    unjournaled: list[int] = field(default_factory=list)

    def is_resolved(self, index: int) -> bool:
        return index < self.watermark or index in self.resolved_above

    def resolve(self, index: int) -> None:
        """Mark one scenario done (trained, or discarded with a reason)."""
        if index < self.watermark or index in self.resolved_above:
            return
        self.unjournaled.append(index)
        self.resolved_above.add(index)
        self._compact()

    def _compact(self) -> None:
        """Raise the watermark over the resolved indices just above it."""
        while self.watermark in self.resolved_above:
            self.resolved_above.remove(self.watermark)
            self.watermark += 1

    def resolve_all(self, indices: Iterable[int]) -> None:
        for index in indices:
            self.resolve(index)

    def begin_batch(self, step: int, indices: Iterable[int]) -> None:
        self.pending = PendingBatch(step=step, scenario_indices=sorted(indices))

    def commit_batch(self) -> None:
        """The pending batch trained: its scenarios are resolved."""
        if self.pending is not None:
            self.resolve_all(self.pending.scenario_indices)
            self.pending = None

    def note_checkpoint(self, step: int, indices: Iterable[int], *, saved: bool) -> None:
        """Step `step` trained `indices`; `saved`: the backend was asked to checkpoint it,
        which covers every step before it too."""
        if saved:
            self.unsaved.clear()
            return
        self.unsaved.append(PendingBatch(step=step, scenario_indices=sorted(indices)))
        # Past the cap the oldest are taken as kept: without an eval (and so a checkpoint)
        # for this many steps, the run has said it keeps none (`eval_every_n_steps=0`).
        del self.unsaved[:-MAX_UNSAVED_STEPS]

    def roll_back_unsaved(self, backend_step: int) -> list[int]:
        """On resume: the scenarios of the unsaved steps after `backend_step` (the backend
        came back without them) are no longer resolved; returns them."""
        lost = sorted(
            i for batch in self.unsaved if batch.step > backend_step
            for i in batch.scenario_indices
        )
        self.unsaved.clear()
        if not lost:
            return lost
        low = lost[0]
        if low < self.watermark:
            # Bounded: the state's checks keep unsaved indices near the watermark.
            self.resolved_above.update(range(low, self.watermark))
            self.watermark = low
        self.resolved_above.difference_update(lost)
        self._compact()
        return lost

    def settle_pending(self, backend_step: int) -> bool:
        """On resume: a pending batch the backend already trained counts as trained.

        Returns True if the pending batch was committed, False if its scenarios will be rolled
        again (or there was none).
        """
        if self.pending is None:
            return False
        trained = backend_step >= self.pending.step
        if trained:
            self.commit_batch()
        else:
            self.pending = None
        return trained
