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
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import (
    ForeignStateError,
    ModelDirectoryLostError,
    RunLockedError,
    StateFileError,
    StateWriteError,
)
from .lock import RunLock

logger = logging.getLogger("art_trio")

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

STATE_FORMAT = "art_trio/2"
"""2: completed evals as runs in the snapshot and as increments in records (1: whole lists,
still read)."""

SCENARIO_DIGESTS = 8
"""How many of the first scenarios are fingerprinted, to refuse a state from another source."""


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


#: The tallies ART 0.5.20+ persists beside the reference's fields (same names and meaning).
TALLY_FIELDS = (
    "accepted_trainable_groups",
    "discarded_stale_groups",
    "discarded_zero_variance_groups",
)


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
    #: ART 0.5.20's running tallies (groups trained; completed groups discarded as stale or
    #: as zero variance), kept across resumes so `discarded/cum/*` continue where they were.
    accepted_trainable_groups: int = 0
    discarded_stale_groups: int = 0
    discarded_zero_variance_groups: int = 0
    #: Fingerprints of the first scenarios of the source (None: no stable form), in order.
    scenario_digests: list[str | None] = field(default_factory=list)
    #: Whether `scenario_digests` grew since the last journal record.
    digests_unjournaled: bool = False
    #: Evals completed since the last journal record (what the next record must carry).
    evals_unjournaled: list[int] = field(default_factory=list)
    #: How many completed evals the journal and snapshot hold; a set that grew otherwise
    #: (code adding to it directly) makes the next record carry the whole list once.
    evals_journaled: int = 0

    def complete_eval(self, step: int) -> None:
        """An eval finished: persisted with the next record, which carries only the new ones."""
        if step in self.completed_eval_steps:
            return
        self.completed_eval_steps.add(step)
        self.evals_unjournaled.append(step)

    def _small_fields(self) -> dict[str, Any]:
        pending = self.ledger.pending
        return {
            "total_scenarios_consumed": self.total_scenarios_consumed,
            "training_step": self.training_step,
            "last_eval_step": self.last_eval_step,
            "pending_eval_steps": self._pending_evals(),
            "pending_batch": (
                None
                if pending is None
                else {"step": pending.step, "scenario_indices": pending.scenario_indices}
            ),
            **self._tallies(),
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
        self.evals_unjournaled[:0] = record["evals_completed"]
        self.evals_journaled -= len(record["evals_completed"])
        if "completed_eval_steps" in record:
            self.evals_journaled = -1  # the next record carries the whole list again
        if "scenario_digests" in record:
            self.digests_unjournaled = True

    def apply_record(self, record: dict[str, Any], where: str = "journal record") -> None:
        """Replay one journal record onto this (older) state."""
        resolved = _index_list(record, "resolved", where)
        newer = PipelineState.from_json({"scenario_offset": 0, **record}, where=where)
        self.ledger.resolve_all(resolved)
        self.ledger.unjournaled.clear()
        self.ledger.pending = newer.ledger.pending
        self.total_scenarios_consumed = newer.total_scenarios_consumed
        self.training_step = newer.training_step
        self.last_eval_step = newer.last_eval_step
        if "completed_eval_steps" in record:
            # The previous format (and the fallback above): the record holds the whole set.
            self.completed_eval_steps = set(newer.completed_eval_steps)
        self.completed_eval_steps.update(_index_list(record, "evals_completed", where))
        self.evals_unjournaled.clear()
        self.evals_journaled = len(self.completed_eval_steps)
        self.pending_eval_steps = newer.pending_eval_steps
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
            scenario_digests=list(digests),
            accepted_trainable_groups=_count(data, TALLY_FIELDS[0], where, default=0),
            discarded_stale_groups=_count(data, TALLY_FIELDS[1], where, default=0),
            discarded_zero_variance_groups=_count(data, TALLY_FIELDS[2], where, default=0),
        )


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


#: A bound on one run's length when a snapshot is read, so a hand-edited count cannot
#: exhaust memory (a million evals is far beyond any run).
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
        return [first + stride * k for first, stride, count in value for k in range(count)]
    raise StateFileError(
        f"{where}: `{key}` must be a list of [first, stride, count] runs of non-negative "
        f"integers (stride >= 1, 1 <= count <= {_MAX_RUN}), found {value!r:.80}"
    )


def _atomic_write_json(path: Path, data: dict[str, Any], *, fsync: bool) -> None:
    """Replace `path` with `data` so readers see the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            # Flushed here, inside the try, so that a full disk raises before the rename and
            # never leaves a short file in place of the old one.
            f.flush()
            if fsync:
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


def _os_write(fd: int, data: bytes | memoryview) -> int:
    # A seam for fault injection (short writes, ENOSPC); real code is os.write.
    return os.write(fd, data)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None if missing; raises ValueError if it is not readable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
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

    `identity` (the model's name and project) is stored with every snapshot; `read()` refuses
    a state stored with another identity. One store per directory at a time: the trainer
    holds `RunLock` while it uses one.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        fsync: bool = False,
        identity: Mapping[str, str] | None = None,
        lock: RunLock | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        #: The run's lock on the directory: checked before every write (see `_check_files`).
        self.lock = lock
        self.fsync = fsync
        self.identity = dict(identity) if identity is not None else None
        self._seq = 0
        self._epoch: str | None = None
        self._records_since_snapshot = 0
        self._journal_fd: int | None = None
        #: The journal's length after the last complete record (where a failed one is cut).
        self._journal_size = 0
        #: Set when a failed append could not be cut back: only a snapshot may follow.
        self._journal_broken = False
        #: The length of the journal's whole records, as `read()` found them (None: unread).
        self._journal_whole: int | None = None
        #: Whether the snapshot file exists as far as this store knows (read or written it).
        self._has_sidecar = False
        #: The directory's (device, inode) when this store first wrote to it.
        self._dir_id: tuple[int, int] | None = None

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
        so ART can read it again. Raises StateFileError naming the file if a file is
        malformed, and ForeignStateError if it was written by another run.
        """
        self._remove_torn_temporaries()
        sidecar = self._read_sidecar()
        try:
            art_state = _read_json(self.art_state_path)
        except ValueError as exc:
            logger.warning(
                "%s is unreadable (%s); rewriting it with the pipeline state from %s. ART's "
                "cumulative metric counters restart from zero.",
                self.art_state_path,
                exc,
                self.sidecar_path.name,
            )
            art_state = {}
            repaired = {} if sidecar is None else {PIPELINE_STATE_KEY: sidecar}
            _atomic_write_json(self.art_state_path, repaired, fsync=True)
        state: PipelineState | None = None
        snapshot: dict[str, Any] | None = None
        where = str(self.sidecar_path)
        advice = _SIDECAR_ADVICE
        self._has_sidecar = sidecar is not None
        if sidecar is not None:
            snapshot = sidecar
        else:
            stored = (art_state or {}).get(PIPELINE_STATE_KEY)
            if stored is not None:
                where = f"{self.art_state_path} key {PIPELINE_STATE_KEY!r}"
                advice = _MIRROR_ADVICE
                if not isinstance(stored, dict):
                    raise StateFileError(
                        f"{where}: expected a JSON object, found {type(stored).__name__}. "
                        + advice
                    )
                snapshot = stored
        epoch: str | None = None
        if snapshot is not None:
            self._check_identity(snapshot, where)
            try:
                state = PipelineState.from_json(snapshot, where=where)
                self._seq = _count(snapshot, "journal_seq", where, default=0)
            except StateFileError as exc:
                raise StateFileError(f"{exc}. {advice}") from None
            raw_epoch = snapshot.get("journal_epoch")
            epoch = raw_epoch if isinstance(raw_epoch, str) else None
        self._epoch = epoch
        for number, record in self._read_journal():
            if not self._belongs(record, epoch, snapshot is not None):
                continue
            if state is None:
                state = PipelineState()
            where_record = f"{self.journal_path} line {number}"
            try:
                state.apply_record(record, where=where_record)
            except StateFileError as exc:
                raise StateFileError(f"{exc}. {_JOURNAL_ADVICE}") from None
            self._seq = record["seq"]
        return state

    def _belongs(self, record: dict[str, Any], epoch: str | None, has_snapshot: bool) -> bool:
        """Whether a journal record follows the snapshot read (and is newer than it)."""
        if not has_snapshot and "epoch" in record:
            # Records carry only what changed since their snapshot; alone they would resume
            # with everything before it forgotten (and trained again).
            raise StateFileError(
                f"{self.journal_path} holds records that follow a snapshot, but neither "
                f"{self.sidecar_path.name} nor state.json's `_pipeline_trainer` key exists. "
                "Restore the snapshot, or delete the journal too and train with resume=False "
                "to start over."
            )
        if record.get("epoch") != epoch:
            # Another generation: records the snapshot already holds (a crash came between
            # the snapshot and the journal's reset), or the run a resume=False replaced.
            return False
        return bool(record["seq"] > self._seq)

    def _check_identity(self, snapshot: Mapping[str, Any], where: str) -> None:
        stored = snapshot.get("run")
        if self.identity is None or not isinstance(stored, Mapping):
            return  # unknown on one side (ART's record, an older art_trio): nothing to compare
        for key, expected in self.identity.items():
            found = stored.get(key)
            if found is not None and found != expected:
                raise ForeignStateError(
                    f"{where} was written by a run of {key} {found!r}, but this run's {key} is "
                    f"{expected!r}: resuming it would skip or repeat scenarios of another run. "
                    "If the files were copied here by mistake, remove art_trio_state.json, "
                    "art_trio_journal.jsonl and the `_pipeline_trainer` key of state.json "
                    "(or train with resume=False to start over)."
                )

    def append(self, state: PipelineState) -> None:
        """Record what changed since the last write; cheap enough to do every step.

        Complete or absent: on any failure (a short write, ENOSPC) the journal is cut back to
        the previous record and StateWriteError is raised; the state keeps what the record
        carried, for the next write.
        """
        self._check_files(state)
        if self._journal_fd is not None and self._journal_changed():
            # Someone cut or wrote the journal behind the lock's back (a truncation, an
            # editor): a record appended now could follow a torn one. The snapshot holds
            # everything and starts the journal over.
            logger.warning(
                "%s was changed by something other than this run (its size is not the one "
                "this run wrote); writing a full snapshot instead of a journal record.",
                self.journal_path,
            )
            self._write_snapshot(state)
            return
        if self._journal_broken:
            raise StateWriteError(
                errno.EIO,
                f"{self.journal_path} could not be cut back after a failed write; only a "
                "snapshot can follow (the run must stop)",
            )
        self._seq += 1
        record = state.journal_record(self._seq)
        if self._epoch is not None:
            record["epoch"] = self._epoch
        line = json.dumps(record, separators=(",", ":")) + "\n"
        try:
            if self._journal_fd is None:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                self._journal_fd = os.open(
                    self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
                )
                self._journal_size = os.fstat(self._journal_fd).st_size
                if self._journal_whole is not None and self._journal_size > self._journal_whole:
                    # A record torn by a crash (or a cut copy) ends the file: appended after
                    # it, the next record would share its line and corrupt the journal.
                    os.ftruncate(self._journal_fd, self._journal_whole)
                    self._journal_size = self._journal_whole
            self._write_record(line.encode())
            if self.fsync:
                os.fsync(self._journal_fd)
        except StateWriteError:
            state.unjournal(record)
            raise
        except OSError as exc:
            # Opening the journal (a read-only or vanished directory) or fsync (an I/O error).
            state.unjournal(record)
            raise StateWriteError(
                exc.errno or errno.EIO,
                f"could not write the resume record to {self.journal_path} "
                f"({exc.strerror or exc}). The run stops before training this batch; fix the "
                "cause (a writable directory, the disk) and resume: nothing trained is lost "
                "or repeated",
                str(self.journal_path),
            ) from exc
        except BaseException:
            state.unjournal(record)
            raise
        self._records_since_snapshot += 1
        if self._records_since_snapshot >= SNAPSHOT_EVERY:
            self.write(state)

    def _write_record(self, data: bytes) -> None:
        """Append `data` whole, or cut the journal back to where it was and raise."""
        assert self._journal_fd is not None
        fd = self._journal_fd
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                n = _os_write(fd, view[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "write returned 0 bytes (disk full?)")
                written += n
        except OSError as exc:
            self._cut_back()
            raise StateWriteError(
                exc.errno or errno.EIO,
                f"could not write the resume record to {self.journal_path} (wrote {written} "
                f"of {len(data)} bytes, then: {exc.strerror or exc}). The run stops before "
                "training this batch; free space (or fix the disk) and resume: nothing "
                "trained is lost or repeated",
                str(self.journal_path),
            ) from exc
        self._journal_size += written

    def _cut_back(self) -> None:
        # Without this, the partial record would sit before the next one, where a reader
        # can no longer tell a torn tail from corruption. Shrinking needs no free space.
        assert self._journal_fd is not None
        try:
            os.ftruncate(self._journal_fd, self._journal_size)
        except OSError:
            self._journal_broken = True

    def write(self, state: PipelineState) -> None:
        """Snapshot the whole state atomically and durably, then start a new journal."""
        self._check_files(state)
        self._write_snapshot(state)

    def _write_file(self, path: Path, data: dict[str, Any], *, fsync: bool) -> None:
        try:
            _atomic_write_json(path, data, fsync=fsync)
        except OSError as exc:
            if isinstance(exc, StateWriteError):
                raise
            raise StateWriteError(
                exc.errno or errno.EIO,
                f"could not write {path} ({exc.strerror or exc}); the previous version is left "
                "whole (a temporary file is renamed over it only once written). The run stops "
                "before training another batch; fix the cause (free space, a writable "
                "directory) and resume: nothing trained is lost or repeated",
                str(path),
            ) from exc

    def _journal_changed(self) -> bool:
        assert self._journal_fd is not None
        return os.fstat(self._journal_fd).st_size != self._journal_size

    def _check_files(self, state: PipelineState) -> None:
        """Stop the run if its directory or files vanished or were replaced (issue 25).

        A cleanup job or a wrong `rm -rf` takes the resume state, the journal and the lock
        file with it, while this process would go on writing to the deleted journal (and
        another run could lock the directory anew). Checked before every write, so at the
        latest at the next step. What this run knows is still whole in memory: it is written
        again (the lock taken again first) before the error is raised, so a resume neither
        repeats nor skips a scenario; what else the directory held is gone.
        """
        problems = []
        directory_gone = False
        if self._dir_id is not None:
            try:
                st = os.stat(self.output_dir)
            except OSError:
                directory_gone = True
            else:
                directory_gone = (st.st_dev, st.st_ino) != self._dir_id
        if self.lock is not None and not self.lock.held:
            problems.append(f"the lock on {self.lock.path} is no longer held")
        elif self.lock is not None:
            problem = self.lock.check()
            if problem is not None:
                problems.append(problem)
        if self._journal_fd is not None:
            try:
                here = os.stat(self.journal_path)
            except OSError:
                problems.append(f"{self.journal_path} was deleted")
            else:
                held = os.fstat(self._journal_fd)
                if (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino):
                    problems.append(f"{self.journal_path} was replaced by another file")
        if self._has_sidecar and not self.sidecar_path.exists():
            problems.append(f"{self.sidecar_path} was deleted")
        if problems or directory_gone:
            self._recover(state, problems, directory_gone)

    def _recover(self, state: PipelineState, problems: list[str], directory_gone: bool) -> None:
        self.close()  # the descriptor of a deleted journal: nothing written there survives
        why = "; ".join(problems)
        try:
            if self.lock is not None:
                self.lock.release()
                self.lock.acquire()
            self._epoch = None
            self._dir_id = None  # the directory written to now is the run's directory
            self._write_snapshot(state)
        except (OSError, RunLockedError) as exc:
            outcome = (
                f"art_trio could not write the run's resume state there again ({exc}): a "
                f"resume from {self.output_dir} as it is now would start at scenario 0 and "
                "train every scenario again. Restore the directory from a backup, or keep "
                "this error's step in mind and skip what was trained by hand"
            )
            code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ENOENT
        else:
            outcome = (
                f"art_trio wrote the run's resume state (training step {state.training_step}, "
                f"which scenarios are trained: every one below {state.ledger.watermark} and "
                f"{len(state.ledger.resolved_above)} above) into {self.output_dir} again, so a "
                "resume neither repeats nor skips a scenario."
            )
            if directory_gone:
                outcome += (
                    " What else the directory held is gone and art_trio cannot bring it back: "
                    "ART's checkpoints (with LocalBackend, the trained weights: the backend "
                    "resumes from the step it still has), history.jsonl, logs. Restore them "
                    "from a backup if you have one; to start over instead, train with "
                    "resume=False"
                )
            code = errno.ENOENT
        what = (
            f"the model directory {self.output_dir} was deleted or replaced"
            if directory_gone
            else f"art_trio's files in the model directory {self.output_dir} were deleted or "
            "replaced"
        )
        raise ModelDirectoryLostError(
            code,
            f"{what} while this run was training ({why or 'the directory is another one'}). "
            f"The run stops: nothing more is written to deleted files. {outcome}",
            str(self.output_dir),
        )

    def _write_snapshot(self, state: PipelineState) -> None:
        epoch = secrets.token_hex(4)
        stamp: dict[str, Any] = {"journal_seq": self._seq, "journal_epoch": epoch}
        if self.identity is not None:
            stamp["run"] = dict(self.identity)
        self._write_file(self.sidecar_path, {**state.to_json(compact=True), **stamp}, fsync=True)
        # From here on, replay ignores records of the previous epoch: the snapshot holds them.
        self._epoch = epoch
        self._has_sidecar = True
        state.ledger.unjournaled.clear()
        state.digests_unjournaled = False
        state.evals_unjournaled.clear()
        state.evals_journaled = len(state.completed_eval_steps)
        self._records_since_snapshot = 0
        # The mirror keeps ART's trainer and tools able to read the reference's fields (the
        # whole `completed_eval_steps` list: ART reads no other form). It need not be
        # durable: the snapshot above already is, and resume prefers it.
        try:
            art_state = _read_json(self.art_state_path) or {}
        except ValueError:
            art_state = {}
        art_state[PIPELINE_STATE_KEY] = {**state.to_json(), **stamp}
        self._write_file(self.art_state_path, art_state, fsync=False)
        if self._dir_id is None:
            st = os.stat(self.output_dir)
            self._dir_id = (st.st_dev, st.st_ino)
        # Records of the old epoch are in the snapshot now; replay skips them even if this
        # truncation never happens.
        if self._journal_fd is not None:
            os.ftruncate(self._journal_fd, 0)
        elif self.journal_path.exists():
            os.truncate(self.journal_path, 0)
        self._journal_size = 0
        self._journal_whole = 0
        self._journal_broken = False

    def close(self) -> None:
        """Close the journal. Idempotent; the store may be used again (it reopens)."""
        fd, self._journal_fd = self._journal_fd, None
        if fd is not None:
            os.close(fd)

    def _remove_torn_temporaries(self) -> None:
        # A kill between writing a temporary file and renaming it leaves it behind; the file
        # it was meant to replace is still whole, so the temporary is garbage.
        for name in (SIDECAR_FILE, self.art_state_path.name):
            for leftover in self.output_dir.glob(f".{name}.*.tmp"):
                leftover.unlink(missing_ok=True)

    def _read_journal(self) -> list[tuple[int, dict[str, Any]]]:
        """The journal's records with their line numbers; a torn last line is left out."""
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            self._journal_whole = 0
            return []
        # Everything up to the last newline is whole records; a torn tail is left out.
        self._journal_whole = raw.rfind(b"\n") + 1
        lines = raw.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        records = []
        for number, line in enumerate(lines, start=1):
            if number == len(lines) and not raw.endswith(b"\n"):
                # Torn by a kill mid-append (a record is written with its newline in one
                # call, which had not returned): that step's train never started. Even if the
                # line parses, it is left out, as append() cuts it off.
                break
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                raise StateFileError(
                    f"{self.journal_path} line {number} is not valid UTF-8 JSON ({exc}); only "
                    f"an unterminated last line can be torn by a crash. {_JOURNAL_ADVICE}"
                ) from None
            if not isinstance(record, dict) or not _is_count(record.get("seq")):
                raise StateFileError(
                    f"{self.journal_path} line {number} is not an art_trio journal record "
                    f"(an object with an integer `seq`), found {line[:80]!r}. "
                    + _JOURNAL_ADVICE
                )
            records.append((number, record))
        return records

    def _read_sidecar(self) -> dict[str, Any] | None:
        try:
            return _read_json(self.sidecar_path)
        except ValueError as exc:
            # Only os.replace ever writes this file, so this means someone edited it by hand.
            raise StateFileError(
                f"{self.sidecar_path} is not a valid UTF-8 JSON object ({exc}). "
                + _SIDECAR_ADVICE
            ) from exc


_SIDECAR_ADVICE = (
    "Restore the file, or delete it to resume from state.json's coarser `_pipeline_trainer` "
    "record, or train with resume=False to start over."
)
_MIRROR_ADVICE = (
    "Fix or delete the `_pipeline_trainer` key of state.json (the run then starts at "
    "scenario 0), or train with resume=False to start over."
)
_JOURNAL_ADVICE = (
    "Restore the file, or delete it to resume from art_trio_state.json alone (the steps since "
    "that snapshot may then be trained again)."
)


__all__ = [
    "JOURNAL_FILE",
    "PIPELINE_STATE_KEY",
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
