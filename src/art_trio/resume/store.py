"""`StateStore`: one model directory's resume state, read (snapshot, then the journal's
newer records) and written (a journal record per step, a snapshot every `SNAPSHOT_EVERY`
records), with the checks that stop a run whose directory or files vanished.

(About 430 lines, over the project's ~400: one class whose read, append, snapshot and
recovery paths share the journal's descriptor, sequence number and epoch; the file formats,
the state's encoding and the journal's parsing live in their own modules.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..messages.errors import (
    ForeignStateError,
    RunLockedError,
    RunLockLostError,
    StateFileError,
    StateWriteError,
)
from ..plumbing.progress import PIPELINE_STATE_KEY
from . import files
from .files import JOURNAL_ADVICE, JOURNAL_FILE, SIDECAR_FILE
from .lock import RunLock
from .state import TALLY_FIELDS, PipelineState, _count

logger = logging.getLogger("art_trio")

#: The fields ART's trainer writes into state.json's record (0.5.20+ adds the tallies).
ART_FIELDS = (
    "scenario_offset", "total_scenarios_consumed", "training_step", "last_eval_step",
    "completed_eval_steps", *TALLY_FIELDS,
)

SNAPSHOT_EVERY = 200
"""Journal records between two snapshots: bounds the journal's size and the replay on resume."""


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
        `_pipeline_trainer` (a run started by ART's trainer), and takes ART's fields from it
        where it is at a later training step (ART's trainer ran since). A torn `state.json`
        is rebuilt so ART can read it again. Raises StateFileError naming the file if a file is
        malformed, and ForeignStateError if it was written by another run.
        """
        self._remove_torn_temporaries()
        sidecar = self._read_sidecar()
        try:
            art_state = files.read_json(self.art_state_path)
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
            files.atomic_write_json(self.art_state_path, repaired, fsync=True)
        state: PipelineState | None = None
        snapshot: dict[str, Any] | None = None
        where = str(self.sidecar_path)
        advice = _SIDECAR_ADVICE
        mirror = (art_state or {}).get(PIPELINE_STATE_KEY)
        if sidecar is not None and isinstance(mirror, dict) and mirror.get("journal") is False:
            # The record in state.json is newer than the snapshot: written by a run that kept
            # no journal (resume=False). That run is the one to resume, at ART's granularity
            # (its consumed count); the snapshot and journal are an earlier run's.
            logger.warning(
                "%s was written by a run that kept no journal after %s: resuming from the "
                "former's `%s` record", self.art_state_path, self.sidecar_path.name,
                PIPELINE_STATE_KEY,
            )
            sidecar = None
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
                raise StateFileError(f"{exc}. {JOURNAL_ADVICE}") from None
            self._seq = record["seq"]
        return self._newest(state, mirror)

    def _newest(self, state: PipelineState | None, mirror: Any) -> PipelineState | None:
        """`state` (this store's snapshot and journal), or, where state.json's record is at a
        later training step, that record's run.

        Every art_trio run snapshots at its start and end, mirror included, and its steps only
        move forward from there: a later record was written by another trainer since (ART's,
        which merges its fields into the key), from the scenarios it drew on. ART's fields are
        taken from it; this store's own (resolved scenarios, a pending or unsaved batch, all
        from before ART's steps) still hold. Evals left pending here were ART's to run: its
        record says which it completed.
        """
        if not self._has_sidecar or state is None or not _later_step(mirror, state):
            return state
        logger.warning(
            "%s records training step %s, past step %s of %s: another trainer (ART's) ran on "
            "this directory since; resuming from its record",
            self.art_state_path, mirror["training_step"], state.training_step,
            self.sidecar_path.name,
        )
        where = f"{self.art_state_path} key {PIPELINE_STATE_KEY!r}"
        ours = state.to_json()
        newer = {**ours, **{k: mirror[k] for k in ART_FIELDS if k in mirror}}
        newer["pending_eval_steps"] = []
        try:
            for key in TALLY_FIELDS:  # ART 0.5.18 leaves them as this store last wrote them
                newer[key] = max(_count(newer, key, where, 0), ours[key])
            return PipelineState.from_json(newer, where=where)
        except StateFileError as exc:
            raise StateFileError(f"{exc}. {_MIRROR_ADVICE}") from None

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
                n = files.os_write(fd, view[written:])
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
            files.atomic_write_json(path, data, fsync=fsync)
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
            if self.lock.lost is not None:
                self._lock_lost(state, self.lock.lost)
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

    def _lock_lost(self, state: PipelineState, why: str) -> None:
        # Not written, not taken back: another run may hold the directory now, or may have
        # trained and left; this run's state written there would undo what that run did.
        self.close()
        assert self.lock is not None
        raise RunLockLostError(
            errno.ENOLCK,
            f"this run lost its lock on the model directory {self.output_dir} ({why}). It "
            "stops without writing its resume state, so as not to write over another run's "
            f"(it was at training step {state.training_step}; its last state write is what a "
            "resume starts from, and a batch in training then is settled against the "
            "backend's step). Find the code in this process that closes or unlocks "
            f"descriptors it did not open (os.closerange, a daemonizing helper) on "
            f"{self.lock.path}",
            str(self.output_dir),
        )

    def _recover(self, state: PipelineState, problems: list[str], directory_gone: bool) -> None:
        self.close()  # the descriptor of a deleted journal: nothing written there survives
        failure: OSError | RunLockedError | None = None
        try:
            if self.lock is not None:
                self.lock.release()
                self.lock.acquire()
            self._epoch = None
            self._dir_id = None  # the directory written to now is the run's directory
            self._write_snapshot(state)
        except (OSError, RunLockedError) as exc:
            failure = exc
        raise files.directory_lost(self.output_dir, state, problems, directory_gone, failure)

    def _write_snapshot(self, state: PipelineState) -> None:
        epoch = secrets.token_hex(4)
        stamp: dict[str, Any] = {"journal_seq": self._seq, "journal_epoch": epoch}
        if self.identity is not None:
            stamp["run"] = dict(self.identity)
        self._write_file(self.sidecar_path, {**state.to_json(compact=True), **stamp}, fsync=True)
        # From here on, replay ignores records of the previous epoch: the snapshot holds them.
        self._epoch = epoch
        self._has_sidecar = True
        state.snapshot_written()
        self._records_since_snapshot = 0
        # The mirror keeps ART's trainer and tools able to read the reference's fields (the
        # whole `completed_eval_steps` list: ART reads no other form). It need not be
        # durable: the snapshot above already is, and resume prefers it.
        try:
            art_state = files.read_json(self.art_state_path) or {}
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
        self._journal_whole, records = files.read_journal(self.journal_path)
        return records

    def _read_sidecar(self) -> dict[str, Any] | None:
        try:
            return files.read_json(self.sidecar_path)
        except ValueError as exc:
            # Only os.replace ever writes this file, so this means someone edited it by hand.
            raise StateFileError(
                f"{self.sidecar_path} is not a valid UTF-8 JSON object ({exc}). "
                + _SIDECAR_ADVICE
            ) from exc


def _later_step(mirror: Any, state: PipelineState) -> bool:
    """Whether `mirror` (state.json's record) is at a later training step than `state`."""
    step = mirror.get("training_step") if isinstance(mirror, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        return False
    return state.training_step is None or step > state.training_step


_SIDECAR_ADVICE = (
    "Restore the file, or delete it to resume from state.json's coarser `_pipeline_trainer` "
    "record, or train with resume=False to start over."
)
_MIRROR_ADVICE = (
    "Fix or delete the `_pipeline_trainer` key of state.json (the run then starts at "
    "scenario 0), or train with resume=False to start over."
)
