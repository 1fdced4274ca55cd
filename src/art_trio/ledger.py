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
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PIPELINE_STATE_KEY = "_pipeline_trainer"
"""Key of the pipeline state inside ART's `state.json` (the reference's, so ART can read it)."""

SIDECAR_FILE = "art_trio_state.json"
"""art_trio's own copy of the pipeline state, next to `state.json`.

ART's `model.log` rewrites `state.json` in place; a kill during that write leaves it torn.
This file is only ever replaced atomically, so resume never depends on ART's write.
"""

JOURNAL_FILE = "art_trio_journal.jsonl"
"""Per-step records newer than the snapshot; appended, never rewritten."""

SNAPSHOT_EVERY = 200
"""Journal records between two snapshots: bounds the journal's size and the replay on resume."""

STATE_FORMAT = "art_trio/1"


@dataclass(slots=True)
class PendingBatch:
    """A batch handed to `backend.train` whose outcome was not yet recorded."""

    step: int
    scenario_indices: list[int]


@dataclass(slots=True)
class ScenarioLedger:
    """Resolution of scenario indices, compacted under a low watermark."""

    watermark: int = 0
    resolved_above: set[int] = field(default_factory=set)
    pending: PendingBatch | None = None
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


@dataclass(slots=True)
class PipelineState:
    """Everything persisted under `_pipeline_trainer`, the reference's four fields first."""

    ledger: ScenarioLedger = field(default_factory=ScenarioLedger)
    total_scenarios_consumed: int = 0
    training_step: int | None = None
    last_eval_step: int = 0
    completed_eval_steps: set[int] = field(default_factory=set)
    #: Eval steps scheduled but not finished: a resumed run evaluates them again.
    pending_eval_steps: set[int] = field(default_factory=set)

    def _small_fields(self) -> dict[str, Any]:
        pending = self.ledger.pending
        return {
            "total_scenarios_consumed": self.total_scenarios_consumed,
            "training_step": self.training_step,
            "last_eval_step": self.last_eval_step,
            "completed_eval_steps": sorted(self.completed_eval_steps),
            "pending_eval_steps": sorted(self.pending_eval_steps - self.completed_eval_steps),
            "pending_batch": (
                None
                if pending is None
                else {"step": pending.step, "scenario_indices": pending.scenario_indices}
            ),
        }

    def journal_record(self, seq: int) -> dict[str, Any]:
        """What changed since the previous record, for the journal."""
        resolved, self.ledger.unjournaled = self.ledger.unjournaled, []
        return {"seq": seq, "resolved": resolved, **self._small_fields()}

    def apply_record(self, record: dict[str, Any]) -> None:
        """Replay one journal record onto this (older) state."""
        self.ledger.resolve_all(int(i) for i in record.get("resolved", []))
        self.ledger.unjournaled.clear()
        newer = PipelineState.from_json({"scenario_offset": 0, **record})
        self.ledger.pending = newer.ledger.pending
        self.total_scenarios_consumed = newer.total_scenarios_consumed
        self.training_step = newer.training_step
        self.last_eval_step = newer.last_eval_step
        self.completed_eval_steps = newer.completed_eval_steps
        self.pending_eval_steps = newer.pending_eval_steps

    def to_json(self) -> dict[str, Any]:
        pending = self.ledger.pending
        return {
            "scenario_offset": self.ledger.watermark,
            "total_scenarios_consumed": self.total_scenarios_consumed,
            "training_step": self.training_step,
            "last_eval_step": self.last_eval_step,
            "completed_eval_steps": sorted(self.completed_eval_steps),
            "pending_eval_steps": sorted(self.pending_eval_steps - self.completed_eval_steps),
            "resolved_scenarios": sorted(self.ledger.resolved_above),
            "pending_batch": (
                None
                if pending is None
                else {"step": pending.step, "scenario_indices": pending.scenario_indices}
            ),
            "format": STATE_FORMAT,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PipelineState:
        """Read art_trio's fields, or the reference's alone (then its offset is the watermark)."""
        offset = int(data.get("scenario_offset", 0) or 0)
        pending_data = data.get("pending_batch")
        pending = (
            PendingBatch(
                step=int(pending_data["step"]),
                scenario_indices=[int(i) for i in pending_data["scenario_indices"]],
            )
            if isinstance(pending_data, dict)
            else None
        )
        ledger = ScenarioLedger(
            watermark=offset,
            resolved_above={
                int(i) for i in data.get("resolved_scenarios", []) or [] if int(i) >= offset
            },
            pending=pending,
        )
        stored_step = data.get("training_step")
        return cls(
            ledger=ledger,
            total_scenarios_consumed=int(data.get("total_scenarios_consumed", offset) or 0),
            training_step=int(stored_step) if stored_step is not None else None,
            last_eval_step=int(data.get("last_eval_step", 0) or 0),
            completed_eval_steps={int(s) for s in data.get("completed_eval_steps", []) or []},
            pending_eval_steps={int(s) for s in data.get("pending_eval_steps", []) or []},
        )


def _atomic_write_json(path: Path, data: dict[str, Any], *, fsync: bool) -> None:
    """Replace `path` with `data` so readers see the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            # The rename is durable only once the directory entry is on disk too.
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None if missing; raises ValueError if it is not readable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


class StateStore:
    """Reads and writes the pipeline state for one model directory (see the module docstring).

    Every write is synchronous on the event loop's thread, the same thread ART's own
    `state.json` writes run on, so the two never interleave. `fsync` makes each journal
    record durable against power loss too, at the cost of a disk sync per step; without it a
    record survives the process dying (kill -9, OOM, Ctrl-C), which is what resume needs.
    """

    def __init__(self, output_dir: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.fsync = fsync
        self._seq = 0
        self._records_since_snapshot = 0
        self._journal_fd: int | None = None

    @property
    def sidecar_path(self) -> Path:
        return self.output_dir / SIDECAR_FILE

    @property
    def journal_path(self) -> Path:
        return self.output_dir / JOURNAL_FILE

    @property
    def art_state_path(self) -> Path:
        return self.output_dir / "state.json"

    def read(self) -> PipelineState | None:
        """The last persisted state, or None for a fresh run.

        Prefers art_trio's own snapshot and journal; falls back to `state.json`'s
        `_pipeline_trainer` (a run started by ART's trainer). A torn `state.json` is rebuilt
        so ART can read it again.
        """
        self._remove_torn_temporaries()
        sidecar = self._read_sidecar()
        try:
            art_state = _read_json(self.art_state_path)
        except ValueError as exc:
            print(
                f"Warning: {self.art_state_path} is unreadable ({exc}); rewriting it with the "
                f"pipeline state from {self.sidecar_path.name}. ART's cumulative metric "
                "counters restart from zero."
            )
            art_state = {}
            repaired = {} if sidecar is None else {PIPELINE_STATE_KEY: sidecar}
            _atomic_write_json(self.art_state_path, repaired, fsync=True)
        state: PipelineState | None = None
        if sidecar is not None:
            state = PipelineState.from_json(sidecar)
            self._seq = int(sidecar.get("journal_seq", 0) or 0)
        else:
            stored = (art_state or {}).get(PIPELINE_STATE_KEY)
            if isinstance(stored, dict):
                state = PipelineState.from_json(stored)
        for record in self._read_journal():
            if record["seq"] <= self._seq:
                continue  # already in the snapshot (a crash came before the journal reset)
            if state is None:
                state = PipelineState()
            state.apply_record(record)
            self._seq = record["seq"]
        return state

    def append(self, state: PipelineState) -> None:
        """Record what changed since the last write; cheap enough to do every step."""
        self._seq += 1
        line = json.dumps(state.journal_record(self._seq), separators=(",", ":")) + "\n"
        if self._journal_fd is None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._journal_fd = os.open(
                self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
            )
        os.write(self._journal_fd, line.encode())
        if self.fsync:
            os.fsync(self._journal_fd)
        self._records_since_snapshot += 1
        if self._records_since_snapshot >= SNAPSHOT_EVERY:
            self.write(state)

    def write(self, state: PipelineState) -> None:
        """Snapshot the whole state atomically and durably, then start a new journal."""
        state.ledger.unjournaled.clear()  # the snapshot holds them
        data = {**state.to_json(), "journal_seq": self._seq}
        _atomic_write_json(self.sidecar_path, data, fsync=True)
        # The mirror keeps ART's trainer and tools able to read the reference's fields. It
        # need not be durable: the snapshot above already is, and resume prefers it.
        try:
            art_state = _read_json(self.art_state_path) or {}
        except ValueError:
            art_state = {}
        art_state[PIPELINE_STATE_KEY] = data
        _atomic_write_json(self.art_state_path, art_state, fsync=False)
        # Records up to _seq are in the snapshot now; replay skips them even if this
        # truncation never happens.
        if self._journal_fd is not None:
            os.ftruncate(self._journal_fd, 0)
        elif self.journal_path.exists():
            os.truncate(self.journal_path, 0)
        self._records_since_snapshot = 0

    def close(self) -> None:
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None

    def _remove_torn_temporaries(self) -> None:
        # A kill between writing a temporary file and renaming it leaves it behind; the file
        # it was meant to replace is still whole, so the temporary is garbage.
        for name in (SIDECAR_FILE, self.art_state_path.name):
            for leftover in self.output_dir.glob(f".{name}.*.tmp"):
                leftover.unlink(missing_ok=True)

    def _read_journal(self) -> list[dict[str, Any]]:
        try:
            lines = self.journal_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):
                    break  # torn by a kill mid-append: that step's train never started
                raise ValueError(
                    f"{self.journal_path} line {number} is not valid JSON; only its last line "
                    "can be torn by a crash. Restore the file, or delete it to resume from "
                    f"{self.sidecar_path.name} alone (the steps since may then be rolled again)."
                ) from None
        return records

    def _read_sidecar(self) -> dict[str, Any] | None:
        try:
            return _read_json(self.sidecar_path)
        except ValueError as exc:
            # Only os.replace ever writes this file, so this means someone edited it by hand.
            raise ValueError(
                f"{self.sidecar_path} is not valid JSON ({exc}). Restore it, or delete it to "
                "resume from state.json's coarser `_pipeline_trainer` record."
            ) from exc


__all__ = [
    "JOURNAL_FILE",
    "PIPELINE_STATE_KEY",
    "SIDECAR_FILE",
    "PendingBatch",
    "PipelineState",
    "ScenarioLedger",
    "StateStore",
]
