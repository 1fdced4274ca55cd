"""The persisted pipeline state (`PipelineState`) and its JSON forms: the snapshot, the
per-step journal record, and their validation (a malformed or foreign file raises
`StateFileError` naming the file, the field and what to do)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..messages.errors import ForeignStateError, StateFileError
from ..plumbing.progress import RunProgress
from .scenarios import MAX_UNSAVED_STEPS, PendingBatch, ScenarioLedger, first_seen_digest

STATE_FORMAT = "art_trio/4"
"""4: unsaved batches as changes in records; 3: pending evals as changes in records; 2:
completed evals as runs in the snapshot and as increments in records; 1: whole lists. All four
are read."""

SCENARIO_DIGESTS = 8
"""How many of the first scenarios are fingerprinted, to refuse a state from another source."""


#: The tallies ART 0.5.20+ persists beside the reference's fields (same names and meaning).
TALLY_FIELDS = (
    "accepted_trainable_groups",
    "discarded_stale_groups",
    "discarded_zero_variance_groups",
)


@dataclass(slots=True)
class PipelineState(RunProgress):
    """Everything persisted under `_pipeline_trainer`: the run's progress (the reference's
    four fields first) with a durable ledger, and what the journal has not yet recorded."""

    ledger: ScenarioLedger = field(default_factory=ScenarioLedger)
    #: Fingerprints of the first scenarios of the source (None: no stable form), in order.
    scenario_digests: list[str | None] = field(default_factory=list)
    #: Whether `scenario_digests` grew since the last journal record.
    digests_unjournaled: bool = False
    #: Evals completed since the last journal record (what the next record must carry).
    evals_unjournaled: list[int] = field(default_factory=list)
    #: How many completed evals the journal and snapshot hold; a set that grew otherwise
    #: (code adding to it directly) makes the next record carry the whole list once.
    evals_journaled: int = 0
    #: The pending evals (not completed) as the journal and snapshot hold them: a record
    #: carries the change from these, not the whole backlog.
    pending_journaled: set[int] = field(default_factory=set)
    #: The unsaved batches as the journal and snapshot hold them (and as they held them
    #: before the last record, for a record that fails): a record carries how many left
    #: from the front and which joined, not the whole list, which reaches 64 batches when
    #: no step is checkpointed and would make every record O(64 x batch size).
    unsaved_journaled: list[PendingBatch] = field(default_factory=list)
    unsaved_before: list[PendingBatch] = field(default_factory=list)
    #: The snapshot file this state belongs to (named in messages; keys `FIRST_SEEN`).
    state_file: str = "the stored state"

    checked_scenarios = SCENARIO_DIGESTS

    # -- the changes a run makes (each persisted with the next record or snapshot) ---------

    def complete_eval(self, step: int) -> None:
        """An eval finished: persisted with the next record, which carries only the new ones."""
        self.pending_eval_steps.discard(step)
        if step in self.completed_eval_steps:
            return
        self.completed_eval_steps.add(step)
        self.evals_unjournaled.append(step)

    def check_scenario(self, index: int, scenario: object) -> None:
        """Refuse a source whose first scenarios differ from the stored state's; record them."""
        digest = first_seen_digest(self.state_file, scenario)
        stored = self.scenario_digests
        if index < len(stored):
            if stored[index] is not None and digest is not None and stored[index] != digest:
                raise ForeignStateError(
                    f"scenario {index} of this run's source differs from scenario {index} of "
                    f"the run whose state is in {self.state_file}: a resumed run must be given "
                    "the same scenarios in the same order, or it skips and repeats the wrong "
                    "ones. Pass the same source, or train with resume=False to start over (if "
                    "the scenarios are the same and only their JSON form changed, delete the "
                    "`scenario_digests` key from that file)."
                )
            return
        if index == len(stored):
            stored.append(digest)
            self.digests_unjournaled = True

    def snapshot_written(self) -> None:
        """A snapshot holds everything: the next journal record starts from it."""
        self.ledger.unjournaled.clear()
        self.digests_unjournaled = False
        self.evals_unjournaled.clear()
        self.evals_journaled = len(self.completed_eval_steps)
        self.pending_journaled = set(self._pending_evals())
        self.unsaved_journaled = list(self.ledger.unsaved)

    def _small_fields(self) -> dict[str, Any]:
        pending = self.ledger.pending
        return {
            "total_scenarios_consumed": self.total_scenarios_consumed,
            "training_step": self.training_step,
            "last_eval_step": self.last_eval_step,
            "pending_batch": (
                None
                if pending is None
                else {"step": pending.step, "scenario_indices": pending.scenario_indices}
            ),
            **self._unsaved_change(),
            **self._tallies(),
        }

    def _unsaved_change(self) -> dict[str, Any]:
        old, new = self.unsaved_journaled, self.ledger.unsaved
        self.unsaved_before, self.unsaved_journaled = old, list(new)
        # Batches leave from the front (a checkpoint covers every step before it; the cap)
        # and join at the end, so the list is some of the old ones followed by new ones.
        dropped = next((i for i, b in enumerate(old) if new and b is new[0]), len(old))
        kept = len(old) - dropped
        if any(a is not b for a, b in zip(old[dropped:], new[:kept], strict=False)):
            return self._unsaved()  # changed some other way: the whole list, once
        added = [{"step": b.step, "scenario_indices": b.scenario_indices} for b in new[kept:]]
        return {"unsaved_dropped": dropped, **({"unsaved_added": added} if added else {})}

    def _unsaved(self) -> dict[str, Any]:
        # Left out when empty (most records: every step checkpointed, or none since the last).
        unsaved = self.ledger.unsaved
        if not unsaved:
            return {}
        return {
            "unsaved_batches": [
                {"step": b.step, "scenario_indices": b.scenario_indices} for b in unsaved
            ]
        }

    def _pending_evals(self) -> list[int]:
        # O(pending), never O(completed): this runs at every step.
        done = self.completed_eval_steps
        return sorted(step for step in self.pending_eval_steps if step not in done)

    def _tallies(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TALLY_FIELDS}

    def journal_record(self, seq: int) -> dict[str, Any]:
        """What changed since the previous record, for the journal.

        Takes the unjournaled resolutions; a caller whose write fails gives them back with
        `unjournal(record)`.
        """
        resolved, self.ledger.unjournaled = self.ledger.unjournaled, []
        record = {"seq": seq, "resolved": resolved, **self._small_fields()}
        # The backlog of pending evals can reach hundreds (evals slower than steps): a
        # record carries what was scheduled and what was dropped without completing (a
        # failed eval) since the last one; completions are `evals_completed` below.
        pending = set(self._pending_evals())
        scheduled = sorted(pending - self.pending_journaled)
        dropped = sorted(self.pending_journaled - pending - self.completed_eval_steps)
        if scheduled:
            record["evals_scheduled"] = scheduled
        if dropped:
            record["evals_dropped"] = dropped
        self.pending_journaled = pending
        evals, self.evals_unjournaled = self.evals_unjournaled, []
        if len(self.completed_eval_steps) == self.evals_journaled + len(evals):
            # Incremental (issue 25): a record is O(what changed), not O(evals so far).
            record["evals_completed"] = evals
        else:
            # The set changed behind complete_eval(): the whole list, which replay takes as
            # the set itself (the previous format's way), once.
            record["completed_eval_steps"] = sorted(self.completed_eval_steps)
            record["evals_completed"] = evals
        self.evals_journaled = len(self.completed_eval_steps)
        if self.digests_unjournaled:
            record["scenario_digests"] = list(self.scenario_digests)
            self.digests_unjournaled = False
        return record

    def unjournal(self, record: dict[str, Any]) -> None:
        """A record was not written: what it carried must go into the next one."""
        self.ledger.unjournaled[:0] = record["resolved"]
        # The journaled backlog as before the record (completed steps aside: they never
        # count as pending), so the next record carries this one's changes again.
        self.pending_journaled = (
            self.pending_journaled - set(record.get("evals_scheduled", ()))
        ) | set(record.get("evals_dropped", ()))
        self.evals_unjournaled[:0] = record["evals_completed"]
        self.evals_journaled -= len(record["evals_completed"])
        if "completed_eval_steps" in record:
            self.evals_journaled = -1  # the next record carries the whole list again
        if "scenario_digests" in record:
            self.digests_unjournaled = True
        self.unsaved_journaled = self.unsaved_before

    def apply_record(self, record: dict[str, Any], where: str = "journal record") -> None:
        """Replay one journal record onto this (older) state."""
        resolved = _index_list(record, "resolved", where)
        newer = PipelineState.from_json({"scenario_offset": 0, **record}, where=where)
        self.ledger.resolve_all(resolved)
        self.ledger.unjournaled.clear()
        self.ledger.pending = newer.ledger.pending
        if "unsaved_dropped" in record:
            dropped = _count(record, "unsaved_dropped", where, default=0)
            added = _unsaved_batches(record, 0, where, key="unsaved_added")
            self.ledger.unsaved = (self.ledger.unsaved[dropped:] + added)[-MAX_UNSAVED_STEPS:]
        else:  # formats 1-3, or a list changed other than at its ends: the whole list
            self.ledger.unsaved = newer.ledger.unsaved
        self.unsaved_journaled = list(self.ledger.unsaved)
        self.total_scenarios_consumed = newer.total_scenarios_consumed
        self.training_step = newer.training_step
        self.last_eval_step = newer.last_eval_step
        if "completed_eval_steps" in record:
            # The previous format (and the fallback above): the record holds the whole set.
            self.completed_eval_steps = set(newer.completed_eval_steps)
        self.completed_eval_steps.update(_index_list(record, "evals_completed", where))
        self.evals_unjournaled.clear()
        self.evals_journaled = len(self.completed_eval_steps)
        if "pending_eval_steps" in record:
            # Formats 1 and 2: the record holds the whole backlog.
            self.pending_eval_steps = newer.pending_eval_steps
        else:
            self.pending_eval_steps |= set(_index_list(record, "evals_scheduled", where))
            self.pending_eval_steps -= set(_index_list(record, "evals_dropped", where))
        self.pending_eval_steps -= self.completed_eval_steps
        self.pending_journaled = set(self.pending_eval_steps)
        for name in TALLY_FIELDS:
            setattr(self, name, getattr(newer, name))
        if "scenario_digests" in record:
            self.scenario_digests = newer.scenario_digests

    def to_json(self, *, compact: bool = False) -> dict[str, Any]:
        """The whole state; the reference's fields as ART writes them.

        `compact` (art_trio's own snapshot): the completed evals as arithmetic runs
        (`completed_eval_runs`, one `[first, stride, count]` for an eval every n steps)
        instead of ART's whole `completed_eval_steps` list, which only the mirror in
        `state.json` keeps, for ART's trainer.
        """
        pending = self.ledger.pending
        if compact:
            evals: dict[str, Any] = {"completed_eval_runs": eval_runs(self.completed_eval_steps)}
        else:
            evals = {"completed_eval_steps": sorted(self.completed_eval_steps)}
        return {
            "scenario_offset": self.ledger.watermark,
            "total_scenarios_consumed": self.total_scenarios_consumed,
            "training_step": self.training_step,
            "last_eval_step": self.last_eval_step,
            **evals,
            "pending_eval_steps": self._pending_evals(),
            "resolved_scenarios": sorted(self.ledger.resolved_above),
            "pending_batch": (
                None
                if pending is None
                else {"step": pending.step, "scenario_indices": pending.scenario_indices}
            ),
            **self._unsaved(),
            **self._tallies(),
            "scenario_digests": list(self.scenario_digests),
            "format": STATE_FORMAT,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "pipeline state") -> PipelineState:
        """Read art_trio's fields, or the reference's alone (then its offset is the watermark).

        Every field is checked; a wrong one raises StateFileError naming `where` and the field.
        """
        if not isinstance(data, Mapping):
            raise StateFileError(
                f"{where}: expected a JSON object, found {type(data).__name__}"
            )
        offset = _count(data, "scenario_offset", where, default=0)
        pending_data = data.get("pending_batch")
        pending = None
        if pending_data is not None:
            if not isinstance(pending_data, Mapping):
                raise StateFileError(
                    f"{where}: `pending_batch` must be an object with `step` and "
                    f"`scenario_indices` or null, found {pending_data!r:.80}"
                )
            if "step" not in pending_data or "scenario_indices" not in pending_data:
                raise StateFileError(
                    f"{where}: `pending_batch` lacks `step` or `scenario_indices` "
                    f"({pending_data!r:.80}); without them resume cannot tell which scenarios "
                    "the interrupted train call held"
                )
            pending = PendingBatch(
                step=_count(pending_data, "step", f"{where} pending_batch", default=None),
                scenario_indices=_index_list(
                    pending_data, "scenario_indices", f"{where} pending_batch"
                ),
            )
        ledger = ScenarioLedger(
            watermark=offset,
            resolved_above={
                i for i in _index_list(data, "resolved_scenarios", where) if i >= offset
            },
            pending=pending,
            unsaved=_unsaved_batches(data, offset, where),
        )
        stored_step = data.get("training_step")
        digests = data.get("scenario_digests")
        if digests is None:
            digests = []
        if not isinstance(digests, list) or not all(
            d is None or isinstance(d, str) for d in digests
        ):
            raise StateFileError(
                f"{where}: `scenario_digests` must be a list of strings or nulls, "
                f"found {digests!r:.80}"
            )
        completed = set(_index_list(data, "completed_eval_steps", where))
        completed.update(_expand_runs(data, "completed_eval_runs", where))
        return cls(
            ledger=ledger,
            total_scenarios_consumed=_count(
                data, "total_scenarios_consumed", where, default=offset
            ),
            training_step=(
                None if stored_step is None else _count(data, "training_step", where, None)
            ),
            last_eval_step=_count(data, "last_eval_step", where, default=0),
            completed_eval_steps=completed,
            evals_journaled=len(completed),
            pending_eval_steps=set(_index_list(data, "pending_eval_steps", where)),
            pending_journaled=set(_index_list(data, "pending_eval_steps", where)) - completed,
            unsaved_journaled=list(ledger.unsaved),
            scenario_digests=list(digests),
            accepted_trainable_groups=_count(data, TALLY_FIELDS[0], where, default=0),
            discarded_stale_groups=_count(data, TALLY_FIELDS[1], where, default=0),
            discarded_zero_variance_groups=_count(data, TALLY_FIELDS[2], where, default=0),
        )


#: How far below the watermark an unsaved batch's scenario may lie: rolling it back re-opens
#: that range, so a hand-edited file cannot make it a huge one.
MAX_UNSAVED_SPAN = 1_000_000


def _unsaved_batches(
    data: Mapping[str, Any], offset: int, where: str, key: str = "unsaved_batches"
) -> list[PendingBatch]:
    raw = data.get(key, [])
    if not isinstance(raw, list) or len(raw) > MAX_UNSAVED_STEPS or not all(
        isinstance(b, Mapping) and "step" in b and "scenario_indices" in b for b in raw
    ):
        raise StateFileError(
            f"{where}: `{key}` must be a list of at most {MAX_UNSAVED_STEPS} objects "
            f"with `step` and `scenario_indices`, found {raw!r:.80}"
        )
    batches = [
        PendingBatch(
            step=_count(b, "step", f"{where} {key}", default=None),
            scenario_indices=_index_list(b, "scenario_indices", f"{where} {key}"),
        )
        for b in raw
    ]
    low = min((i for b in batches for i in b.scenario_indices), default=offset)
    if offset - low > MAX_UNSAVED_SPAN:
        raise StateFileError(
            f"{where}: `{key}` holds scenario {low}, {offset - low} below the "
            f"watermark {offset} (at most {MAX_UNSAVED_SPAN}): the file was edited or is not "
            "art_trio's; delete it to start over"
        )
    return batches


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(data: Mapping[str, Any], key: str, where: str, default: int | None) -> int:
    """A non-negative integer field (null or missing: `default`, if there is one)."""
    value = data.get(key)
    if value is None and default is not None:
        return default
    if not _is_count(value):
        missing = key not in data
        found = "it is missing" if missing else f"found {value!r:.60}"
        raise StateFileError(f"{where}: `{key}` must be a non-negative integer; {found}")
    assert isinstance(value, int)
    return value


def _index_list(data: Mapping[str, Any], key: str, where: str) -> list[int]:
    """A list of non-negative integers (null or missing: empty)."""
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_count(v) for v in value):
        raise StateFileError(
            f"{where}: `{key}` must be a list of non-negative integers, found {value!r:.80}"
        )
    return value


#: A bound on the evals the runs of one snapshot expand to (all runs together), so a
#: hand-edited count cannot exhaust memory (a million evals is far beyond any run).
_MAX_RUN = 10**6


def eval_runs(steps: Iterable[int]) -> list[list[int]]:
    """Sorted steps as arithmetic runs `[first, stride, count]`: `{0, 2, 4, 6, 9}` is
    `[[0, 2, 4], [9, 1, 1]]`. Evals every n steps, with gaps only where one failed, are a
    handful of runs whatever the run's length."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs:
            first, stride, count = runs[-1]
            last = first + stride * (count - 1)
            if count == 1 and step > first:
                runs[-1] = [first, step - first, 2]
                continue
            if step - last == stride:
                runs[-1][2] += 1
                continue
        runs.append([step, 1, 1])
    return runs


def _expand_runs(data: Mapping[str, Any], key: str, where: str) -> list[int]:
    """The steps of `eval_runs`' form (null or missing: none)."""
    value = data.get(key)
    if value is None:
        return []
    if isinstance(value, list) and all(
        isinstance(run, list) and len(run) == 3 and all(_is_count(v) for v in run)
        and 1 <= run[2] <= _MAX_RUN and (run[1] >= 1 or run[2] == 1)
        for run in value
    ):
        total = sum(run[2] for run in value)
        if total > _MAX_RUN:
            # Checked before anything is expanded: 100 runs of a million in a 3 KB file.
            raise StateFileError(
                f"{where}: `{key}` describes {total} completed evals in all, more than the "
                f"{_MAX_RUN} any run could have done: the file was edited or corrupted. "
                "Restore it, or delete it to resume from state.json's record, or train "
                "with resume=False to start over"
            )
        return [first + stride * k for first, stride, count in value for k in range(count)]
    raise StateFileError(
        f"{where}: `{key}` must be a list of [first, stride, count] runs of non-negative "
        f"integers (stride >= 1, 1 <= count <= {_MAX_RUN}), found {value!r:.80}"
    )
