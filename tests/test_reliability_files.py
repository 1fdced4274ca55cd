"""Issue 25, round three on the files: the run lock, the ledger and journal, scenario
fingerprints (cases 3, 7, 8, 10, 13, 17, and the faults tried beyond them).

What a user may rely on (each is a test below, named after it):

- scenario fingerprints never end a run: attribute-dicts, a raising `model_dump`, keys that
  cannot be sorted are "no stable form"; a rollout that annotates its scenario does not make
  a resume with the same objects look foreign, and another list still does;
- the lock is held by the trainer's process alone: a forked helper that outlives a kill -9'd
  trainer does not keep the directory locked; two trainers in one process, in two threads,
  or through a symlink are refused; a filesystem without locks is a clear error with a way
  out (`ART_TRIO_RUN_LOCK=off`);
- journal records and snapshots carry the completed evals incrementally (records) and as
  arithmetic runs (snapshots), not the whole list; state written in the previous format
  resumes exactly;
- the model directory deleted or replaced during a run stops it at the next state write with
  an error naming the directory, after saving the resume state again, so nothing trains twice;
- full disks at a snapshot, a read-only directory, a file in the directory's place, a journal
  cut mid-record, a clock going backwards: clear errors, nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.messages.errors import (
    ForeignStateError,
    ModelDirectoryError,
    ModelDirectoryLostError,
    RunLockedError,
    StateWriteError,
)
from art_trio.plumbing.compat import trainable_model
from art_trio.resume import files as ledger_files
from art_trio.resume import lock as lock_module
from art_trio.resume import store as ledger_store
from art_trio.resume.files import JOURNAL_FILE, SIDECAR_FILE
from art_trio.resume.lock import LOCK_ENV, LOCK_FILE, RunLock
from art_trio.resume.scenarios import scenario_digest
from art_trio.resume.state import TALLY_FIELDS, PipelineState, eval_runs
from art_trio.resume.store import StateStore
from tests.crash_harness import TRAINED_LOG, Child, Harness, read_trained
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory
from tests.errors import find_leaf


def _trainer(
    model: art.TrainableModel,
    backend: Any,
    source: Any = None,
    rollout_fn: Any = asyncio_rollout,
    eval_fn: Any = None,
    **kwargs: Any,
) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 4,
        "min_batch_size": 2,
        "max_batch_size": 2,
        "eval_step_0": False,
        "log_interval_seconds": 3600.0,
    }
    options.update(kwargs)
    return PipelineTrainer(
        model, backend, rollout_fn, scenarios(200) if source is None else source, None,
        eval_fn, **options,
    )


def _out(model: art.TrainableModel) -> Path:
    return Path(model._get_output_dir())


def _assert_exactly_once(model: art.TrainableModel, backend: RecordingBackend) -> None:
    trained = backend.trained_ids
    assert len(trained) == len(set(trained)), "a scenario was trained twice"
    state = StateStore(_out(model)).read()
    assert state is not None
    assert set(range(state.ledger.watermark)) <= set(trained), "a scenario was skipped"


# == 10: attribute-dict scenarios ==============================================================


class AttrDict(dict[str, Any]):
    """The common idiom: attribute access on a dict, KeyError (not AttributeError) if absent."""

    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


def test_fingerprints_of_attribute_dicts_and_odd_objects_never_raise() -> None:
    plain = {"metadata": {"scenario_id": 1}, "i": 1}
    assert scenario_digest(AttrDict(plain)) == scenario_digest(plain)

    class RaisingDump:
        def model_dump(self, **kwargs: Any) -> Any:
            raise RuntimeError("a user's model_dump that fails")

    class Cycle(dict[str, Any]):
        pass

    cycle = Cycle()
    cycle["self"] = cycle
    assert scenario_digest(RaisingDump()) is None
    assert scenario_digest(cycle) is None
    assert scenario_digest({1: "a", "b": 2}) is None  # keys sort cannot order
    # A dict key named like pydantic's method is data, not a method to call.
    assert scenario_digest({"model_dump": 1}) is not None


async def test_attribute_dict_scenarios_train_and_resume(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    def source() -> list[AttrDict]:
        return [AttrDict(s, metadata=AttrDict(s["metadata"])) for s in scenarios(100)]

    await _trainer(model, backend, source=source(), max_steps=3).train(handle_signals=False)
    await _trainer(model, backend, source=source(), max_steps=3).train(handle_signals=False)
    assert backend.step == 6
    _assert_exactly_once(model, backend)
    # Still checked: another order of the same attribute-dicts is refused.
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, source=source()[::-1], max_steps=1).train(
            handle_signals=False
        )
    leaf, _ = find_leaf(excinfo.value, ForeignStateError)
    assert isinstance(leaf, ForeignStateError)


# == 17: rollouts that annotate their scenario ================================================


async def annotating_rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
    scenario["seen"] = scenario.get("seen", 0) + 1  # the habit: mark what was rolled
    return await asyncio_rollout(model, scenario, config)


async def test_a_rollout_annotating_its_scenario_does_not_make_the_same_list_foreign(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    source = scenarios(100)
    await _trainer(model, backend, source, annotating_rollout, max_steps=3).train(
        handle_signals=False
    )
    assert source[0]["seen"] == 1  # the objects were annotated
    await _trainer(model, backend, source, annotating_rollout, max_steps=3).train(
        handle_signals=False
    )
    assert backend.step == 6
    _assert_exactly_once(model, backend)
    # The stored fingerprints are those of the scenarios as first yielded: a fresh copy of
    # the original list (another program) resumes too ...
    await _trainer(model, backend, scenarios(100), annotating_rollout, max_steps=2).train(
        handle_signals=False
    )
    assert backend.step == 8
    _assert_exactly_once(model, backend)
    # ... and a truly different list is still refused.
    different = [{**s, "i": s["i"] + 1} for s in scenarios(100)]
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, different, annotating_rollout, max_steps=1).train(
            handle_signals=False
        )
    leaf, _ = find_leaf(excinfo.value, ForeignStateError)
    assert isinstance(leaf, ForeignStateError) and "scenario 0" in str(leaf)
    assert backend.step == 8


# == 7: a forked helper outliving a kill -9'd trainer =========================================


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _run_dir_model_dir(run_dir: Path) -> Path:
    return run_dir / ".art" / "p" / "models" / "crash"


@pytest.mark.parametrize("kind", ["mp-fork", "os-fork", "subprocess"])
def test_a_forked_helper_outliving_a_killed_trainer_does_not_keep_the_directory_locked(
    harness: Harness, tmp_path: Path, kind: str
) -> None:
    """A rollout forks a helper (multiprocessing "fork", os.fork, subprocess without
    close_fds) that sleeps on; the trainer is killed with -9; a resume trains at once."""
    run_dir = tmp_path / "run"
    first = Child(harness, f"train {run_dir} 100000 1 {kind}")
    assert first.wait_for("helper"), first.lines
    helper = int(next(line for line in first.lines if line.startswith("helper")).split()[1])
    try:
        assert first.wait_for("step", 2), first.lines
        assert first.kill() == -signal.SIGKILL
        assert _alive(helper), "the helper died with the trainer: nothing was tested"
        steps = len(read_trained(run_dir / TRAINED_LOG))
        resumed = Child(harness, f"train {run_dir} {steps + 3} 3")
        assert not resumed.wait_for("never")
        stderr = (tmp_path / "harness-stderr.txt").read_text()
        assert resumed.exit_code == 0, (resumed.lines, stderr[-2000:])
        assert _alive(helper)
        records = read_trained(run_dir / TRAINED_LOG)
        assert len(records) == steps + 3
        trained = [i for r in records for i in r["ids"]]
        assert len(trained) == len(set(trained)), "a scenario was trained twice"
    finally:
        try:
            os.kill(helper, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # And the other way round: the helper holds no lock of its own either (it was forked
    # while the trainer held it): with the trainer gone, a RunLock here is free.
    lock = RunLock(_run_dir_model_dir(run_dir))
    lock.acquire()
    lock.release()


def _hold_in_other_process(path: Path) -> subprocess.Popen[str] | None:
    """Another process holding the POSIX lock on `path` until its stdin closes; None if it
    could not take it."""
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
        "try:\n"
        "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except OSError:\n"
        "    print('busy', flush=True)\n"
        "    sys.exit(0)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if proc.stdout.readline() == "locked\n":
        return proc
    proc.communicate("")
    return None


def test_this_process_reopening_the_lock_file_does_not_drop_the_lock(tmp_path: Path) -> None:
    """A POSIX record lock drops when the process closes any descriptor of the file (a copy
    of the directory made in the trainer's process); the OFD lock does not, and `check()`,
    run at every state write, finds it held."""
    lock = RunLock(tmp_path / "m")
    lock.acquire()
    (lock.path).read_bytes()  # opens and closes the file
    assert lock.check() is None
    assert _hold_in_other_process(lock.path) is None  # still held: another process fails
    lock.release()
    other = _hold_in_other_process(lock.path)
    assert other is not None
    other.communicate("")


# == 13 and beyond: directories the lock cannot use ==========================================


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
async def test_a_filesystem_without_locks_is_a_clear_error_with_a_way_out(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
) -> None:
    def unsupported(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(lock_module, "_os_lock", unsupported)
    with pytest.raises(ModelDirectoryError) as excinfo:
        await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    message = str(excinfo.value)
    assert excinfo.value.errno == code
    assert str(_out(model)) in message and "does not support file locks" in message
    assert f"{LOCK_ENV}=off" in message
    assert backend.calls == []
    # The way out: without the OS lock the run trains, and this process still refuses a
    # second trainer on the directory.
    monkeypatch.setenv(LOCK_ENV, "off")
    first = _trainer(model, backend, max_steps=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(first.train, handle_signals=False))
        with pytest.raises(RunLockedError):
            await _trainer(model, backend, max_steps=1).train(handle_signals=False)
    assert backend.step == 3
    _assert_exactly_once(model, backend)


async def test_a_file_in_the_model_directorys_place_is_a_clear_error(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    out = _out(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("not a directory")
    with pytest.raises(ModelDirectoryError) as excinfo:
        await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    assert str(out) in str(excinfo.value) and "not a directory" in str(excinfo.value)
    assert out.read_text() == "not a directory"  # left as it was
    assert backend.calls == []


def test_two_trainers_in_two_threads_or_through_a_symlink_are_refused(
    tmp_path: Path, backend: RecordingBackend
) -> None:
    """Two threads of one program (each its own trio.run), one of them reaching the model
    directory through a symlinked base_path: the lock is per file, not per path or thread."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")

    def model_at(base: Path) -> art.TrainableModel:
        m = trainable_model(name="m", project="p", base_model="b", base_path=str(base))
        asyncio.run(m.register(backend))
        return m

    real, linked = model_at(tmp_path / "real"), model_at(tmp_path / "link")
    running = threading.Event()
    release = threading.Event()
    outcome: list[BaseException | None] = []

    def first() -> None:
        async def main() -> None:
            trainer = _trainer(real, backend, max_steps=2)
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(trainer.train, handle_signals=False))
                running.set()
                await trio.to_thread.run_sync(release.wait)

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert running.wait(60)
        with pytest.raises(RunLockedError) as excinfo:
            trio.run(functools.partial(_trainer(linked, backend, max_steps=2).train,
                                       handle_signals=False))
        assert f"pid {os.getpid()}" in str(excinfo.value)
    finally:
        release.set()
        thread.join(60)
    assert outcome == [None]
    assert backend.step == 2
    _assert_exactly_once(real, backend)


# == 8: completed evals, incrementally ========================================================


def test_eval_runs_round_trip_and_stay_few() -> None:
    for steps in [set(), {0}, {3, 4}, {0, 2, 4, 6, 9}, set(range(0, 4000, 5)) - {35, 700}]:
        runs = eval_runs(steps)
        data = {"completed_eval_runs": runs}
        assert PipelineState.from_json(data).completed_eval_steps == steps
    assert eval_runs(range(0, 10_000, 3)) == [[0, 3, 3334]]
    assert len(eval_runs(set(range(0, 4000, 5)) - {35, 700})) == 3


async def test_journal_records_do_not_grow_with_the_evals_done(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eval every step for 120 steps: every record carries only what changed, and the
    final snapshot the completed evals as one run; the resumed run knows all of them."""
    records: list[dict[str, Any]] = []
    real_write = ledger_files.os_write

    def spy(fd: int, data: bytes | memoryview) -> int:
        records.append(json.loads(bytes(data)))
        return real_write(fd, data)

    monkeypatch.setattr(ledger_files, "os_write", spy)
    evaluated: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        evaluated.append(step)
        return [trajectory(0.5)]

    await _trainer(
        model, backend, scenarios(300), eval_fn=eval_fn, max_steps=120, eval_every_n_steps=1,
        eval_step_0=True,
    ).train(handle_signals=False)
    assert backend.step == 120 and len(evaluated) == 121
    assert len(records) >= 240  # one per step, one per eval
    assert not any("completed_eval_steps" in r for r in records)
    assert max(len(r["evals_completed"]) for r in records) <= 2
    sizes = [len(json.dumps(r)) for r in records]
    # Records late in the run are as small as early ones (digits of growing numbers aside).
    assert max(sizes[-20:]) <= max(sizes[5:25]) + 16, (sizes[5:25], sizes[-20:])
    sidecar = json.loads((_out(model) / SIDECAR_FILE).read_text())
    assert sidecar["completed_eval_runs"] == [[0, 1, 121]]
    assert "completed_eval_steps" not in sidecar
    state = StateStore(_out(model)).read()
    assert state is not None and state.completed_eval_steps == set(range(121))


def _old_format_dir(out: Path) -> None:
    """A state directory as the previous format wrote it (art_trio/1): whole eval lists in the
    snapshot and in every record. Steps 0-4 trained (scenarios 0-9), evals 0-3 done, step 4's
    eval interrupted, and step 5 (scenarios 10, 11) in backend.train when the run was killed."""
    out.mkdir(parents=True, exist_ok=True)
    run = {"model": "m", "project": "p"}
    tallies = {name: 0 for name in TALLY_FIELDS}
    snapshot = {
        "scenario_offset": 6, "total_scenarios_consumed": 6, "training_step": 3,
        "last_eval_step": 3, "completed_eval_steps": [0, 1, 2], "pending_eval_steps": [3],
        "resolved_scenarios": [], "pending_batch": None, **tallies, "scenario_digests": [],
        "format": "art_trio/1", "journal_seq": 7, "journal_epoch": "0123abcd", "run": run,
    }
    (out / SIDECAR_FILE).write_text(json.dumps(snapshot, indent=2))
    lines = [
        {"seq": 8, "resolved": [], "total_scenarios_consumed": 8, "training_step": 3,
         "last_eval_step": 3, "completed_eval_steps": [0, 1, 2, 3], "pending_eval_steps": [],
         "pending_batch": {"step": 4, "scenario_indices": [6, 7]}, **tallies},
        {"seq": 9, "resolved": [6, 7, 8, 9], "total_scenarios_consumed": 12, "training_step": 4,
         "last_eval_step": 4, "completed_eval_steps": [0, 1, 2, 3], "pending_eval_steps": [4],
         "pending_batch": {"step": 5, "scenario_indices": [10, 11]}, **tallies},
    ]
    (out / JOURNAL_FILE).write_text(
        "".join(json.dumps({**line, "epoch": "0123abcd"}) + "\n" for line in lines)
    )


async def test_a_state_directory_of_the_previous_format_resumes_exactly(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    _old_format_dir(_out(model))
    backend.step = 4  # the kill came before step 5 trained
    evaluated: list[int] = []

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        evaluated.append(step)
        return [trajectory(0.5)]

    await _trainer(model, backend, eval_fn=eval_fn, max_steps=3, eval_every_n_steps=1).train(
        handle_signals=False
    )
    # Step 4's interrupted eval first; 0-3 are not evaluated again; then every new step.
    assert evaluated == [4, 5, 6, 7]
    trained = backend.trained_ids
    assert sorted(trained) == list(range(10, 16))  # 0-9 not again, 10-11 (step 5's) again
    state = StateStore(_out(model)).read()
    assert state is not None
    assert state.completed_eval_steps == set(range(8)) and state.ledger.watermark == 16
    sidecar = json.loads((_out(model) / SIDECAR_FILE).read_text())
    assert sidecar["format"] == "art_trio/4" and sidecar["completed_eval_runs"] == [[0, 1, 8]]


def test_an_eval_set_changed_behind_complete_eval_is_journaled_whole_once(
    tmp_path: Path,
) -> None:
    """Code that adds to `completed_eval_steps` directly (not through complete_eval) is not
    lost: the next record carries the whole list, replayed as the set itself."""
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    state.complete_eval(0)
    store.append(state)
    state.completed_eval_steps.add(1)  # behind complete_eval's back
    state.complete_eval(2)
    store.append(state)
    state.complete_eval(3)
    store.append(state)
    lines = [json.loads(line) for line in (tmp_path / JOURNAL_FILE).read_text().splitlines()]
    assert [("completed_eval_steps" in r, r["evals_completed"]) for r in lines] == [
        (False, [0]), (True, [2]), (False, [3])
    ]
    again = StateStore(tmp_path).read()
    assert again is not None and again.completed_eval_steps == {0, 1, 2, 3}


# == 3: the model directory deleted while train() runs ========================================


class _DeletingBackend(RecordingBackend):
    """Deletes the model directory (a wrong `rm -rf`) right after training step `delete_at`."""

    delete_at = 3

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
        result = await super().train(model, trajectory_groups, **kwargs)
        if self.step == self.delete_at:
            shutil.rmtree(model._get_output_dir())
        return result


def _deleted_files_open(directory: Path) -> list[str]:
    """Files under `directory` this process still holds open although they were deleted."""
    return [
        path for path in _open_files()
        if path.startswith(str(directory)) and path.endswith(" (deleted)")
    ]


def _open_files() -> set[str]:
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return paths


@pytest.mark.parametrize("with_eval", [False, True])
async def test_the_model_directory_deleted_mid_run_stops_it_and_nothing_trains_twice(
    model: art.TrainableModel, autojump_clock: trio.abc.Clock, with_eval: bool
) -> None:
    backend = _DeletingBackend()
    object.__setattr__(model, "_backend", backend)
    out = _out(model)

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        return [trajectory(0.5)]

    kwargs: dict[str, Any] = {"eval_fn": eval_fn, "eval_every_n_steps": 1} if with_eval else {}
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, max_steps=10, **kwargs).train(handle_signals=False)
    leaf, _ = find_leaf(excinfo.value, ModelDirectoryLostError)
    assert isinstance(leaf, ModelDirectoryLostError) and isinstance(leaf, ModelDirectoryError)
    message = str(leaf)
    assert str(out) in message and "deleted" in message
    assert "neither repeats nor skips" in message and "checkpoints" in message
    # Stopped at the next state write: no step after the deletion reached backend.train.
    assert backend.step == backend.delete_at == backend.train_started
    assert _deleted_files_open(out) == []
    # The resume state is there again, whole: the resume trains on, nothing twice.
    assert (out / SIDECAR_FILE).exists()
    backend.delete_at = -1
    await _trainer(model, backend, max_steps=3, **kwargs).train(handle_signals=False)
    assert backend.step == 6
    _assert_exactly_once(model, backend)


@pytest.mark.parametrize("victim", [LOCK_FILE, JOURNAL_FILE, SIDECAR_FILE])
async def test_one_of_the_runs_files_deleted_mid_run_stops_it_and_nothing_trains_twice(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    victim: str,
) -> None:
    """Only the lock file (another run could lock the directory anew), only the journal, or
    only the snapshot: each is found at the next write, the state is written again."""
    out = _out(model)
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        result = await original_train(model, groups, **kwargs)
        if backend.step == 2:
            (out / victim).unlink()
        return result

    backend.train = train  # type: ignore[method-assign]
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, max_steps=10).train(handle_signals=False)
    leaf, _ = find_leaf(excinfo.value, ModelDirectoryLostError)
    assert str(out / victim) in str(leaf), leaf
    # Only art_trio's file went: the error does not claim the rest of the directory is gone.
    assert "art_trio's files in the model directory" in str(leaf)
    assert "neither repeats nor skips" in str(leaf) and "checkpoints" not in str(leaf)
    assert backend.step == 2
    backend.train = original_train  # type: ignore[method-assign]
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    assert backend.step == 5
    _assert_exactly_once(model, backend)


def _delete_while_written(directory: Path) -> None:
    """Delete a directory a live process keeps writing into: moved away at once (so the
    process sees it gone at its next write), then removed. An `rm -rf` retried until the
    directory stays empty would also delete the resume state the process writes back."""
    doomed = directory.with_name(directory.name + ".deleted")
    directory.rename(doomed)
    shutil.rmtree(doomed)


def test_the_model_directory_deleted_under_a_live_process_then_kill_9_and_resume(
    harness: Harness, tmp_path: Path
) -> None:
    """The real thing: another process deletes the model directory of a training process.
    The trainer stops with the error naming it (or is killed with -9 once it wrote its state
    again); the resume trains on, nothing twice."""
    run_dir = tmp_path / "run"
    out = _run_dir_model_dir(run_dir)
    first = Child(harness, f"train {run_dir} 100000 5")
    assert first.wait_for("step", 3), first.lines
    _delete_while_written(out)
    first.wait_for("never")  # it ends on its own, at its next state write
    assert first.exit_code == 1, first.lines
    stderr = (tmp_path / "harness-stderr.txt").read_text()
    assert "ModelDirectoryLostError" in stderr and str(out) in stderr
    assert first.kill() == 1  # already gone: a kill -9 now changes nothing
    steps = len(read_trained(run_dir / TRAINED_LOG))
    resumed = Child(harness, f"train {run_dir} {steps + 3} 6")
    assert not resumed.wait_for("never")
    assert resumed.exit_code == 0, resumed.lines
    records = read_trained(run_dir / TRAINED_LOG)
    assert len(records) == steps + 3
    trained = [i for r in records for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a scenario was trained twice"


@pytest.mark.parametrize("how", ["moved away", "replaced by a file"])
async def test_the_model_directory_moved_or_replaced_by_a_file_mid_run(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    how: str,
) -> None:
    out = _out(model)
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        result = await original_train(model, groups, **kwargs)
        if backend.step == 2:
            out.rename(out.with_name("moved"))
            if how == "replaced by a file":
                out.write_text("a file now")
        return result

    backend.train = train  # type: ignore[method-assign]
    with warnings.catch_warnings(), pytest.raises(BaseExceptionGroup) as excinfo:
        warnings.simplefilter("ignore", RuntimeWarning)
        await _trainer(model, backend, max_steps=10).train(handle_signals=False)
    assert backend.step == 2
    backend.train = original_train  # type: ignore[method-assign]
    if how == "moved away":
        leaf, _ = find_leaf(excinfo.value, ModelDirectoryLostError)
        message = str(leaf)
        assert str(out) in message
        # Written again where the run lives: the resume there trains on, nothing twice.
        assert "neither repeats nor skips" in message
        await _trainer(model, backend, max_steps=3).train(handle_signals=False)
        assert backend.step == 5
        _assert_exactly_once(model, backend)
    else:
        # ART's model.log, writing under the directory right after the step, fails first
        # (the first error wins); the state's error follows in a note: nowhere to write it,
        # and what a resume would do. The file is left alone.
        leaf, notes = find_leaf(excinfo.value, NotADirectoryError)
        note = next(n for n in notes if "ModelDirectoryLostError" in n)
        assert str(out) in note and "not a directory" in note
        assert "could not write the run's resume state there again" in note
        assert out.read_text() == "a file now"


# == beyond: the journal cut mid-record =======================================================


def _record(store: StateStore, state: PipelineState, index: int) -> None:
    state.ledger.resolve(index)
    state.ledger.begin_batch(index + 1, [1000 + index])
    state.training_step = index
    store.append(state)


def test_a_journal_cut_mid_record_resumes_and_the_next_record_does_not_join_the_torn_one(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    for i in range(3):
        _record(store, state, i)
    store.close()
    journal = tmp_path / JOURNAL_FILE
    whole = journal.read_bytes()
    for cut in (7, 1):  # mid-record, and only its newline (the record itself parses)
        journal.write_bytes(whole[:-cut])
        again = StateStore(tmp_path)
        resumed = again.read()
        assert resumed is not None
        # As after the second record: the third one's train call never started.
        assert resumed.ledger.watermark == 2 and resumed.training_step == 1
        # Appending goes on after the last whole record, not after the torn bytes.
        _record(again, resumed, 2)
        again.close()
        third = StateStore(tmp_path).read()
        assert third is not None and third.ledger.watermark == 3
        assert third.ledger.pending is not None and third.ledger.pending.step == 3
        assert journal.read_bytes() == whole


async def test_a_journal_truncated_by_someone_else_mid_run_is_replaced_by_a_snapshot(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = _out(model)
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        result = await original_train(model, groups, **kwargs)
        if backend.step == 3:
            journal = out / JOURNAL_FILE
            os.truncate(journal, journal.stat().st_size - 9)  # cut mid-record
        return result

    backend.train = train  # type: ignore[method-assign]
    await _trainer(model, backend, max_steps=6).train(handle_signals=False)
    assert backend.step == 6
    assert "changed by something other than this run" in caplog.text
    backend.train = original_train  # type: ignore[method-assign]
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    _assert_exactly_once(model, backend)


# == beyond: full disks and read-only directories =============================================


def _mount_tmpfs(directory: Path, options: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _remount(directory: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(directory)], check=True)


@pytest.fixture
def mounted(model: art.TrainableModel) -> Iterator[Path]:
    """The model's output directory on a fresh 4 MiB tmpfs, unmounted at the end."""
    out = _out(model)
    _mount_tmpfs(out, "size=4m")
    try:
        yield out
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def _fill(path: Path) -> None:
    """Fill the filesystem holding `path` until not one byte fits."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


async def test_a_full_disk_before_the_run_is_a_clear_error_and_trains_nothing(
    model: art.TrainableModel, mounted: Path, autojump_clock: trio.abc.Clock
) -> None:
    backend = RecordingBackend(write_checkpoints=False)
    object.__setattr__(model, "_backend", backend)
    _fill(mounted / "filler.bin")
    with pytest.raises(StateWriteError) as excinfo:
        await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    assert excinfo.value.errno == errno.ENOSPC
    assert str(mounted / SIDECAR_FILE) in str(excinfo.value), excinfo.value
    assert "free space" in str(excinfo.value)
    assert backend.calls == []
    (mounted / "filler.bin").unlink()
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    assert backend.step == 3
    _assert_exactly_once(model, backend)


class _FillingBackend(RecordingBackend):
    """Fills the disk at the end of step `fill_at`, after ART's model.log wrote its files
    (checkpoints off): the next write to the disk is the run's state."""

    fill_at = 5

    async def prune_model_adapters(self, model: Any, retain_steps: set[int]) -> None:
        asyncio.get_running_loop()
        if self.step == self.fill_at:
            _fill(Path(model._get_output_dir()) / "filler.bin")


async def test_a_disk_full_at_a_periodic_snapshot_stops_before_training_and_resumes(
    model: art.TrainableModel,
    mounted: Path,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot every 3 records, the disk full after step 5: whichever state write fails
    first (a record may still fit in its block, a snapshot needs a new file), it is a
    StateWriteError with ENOSPC, no train call follows it, and the resume is exact."""
    monkeypatch.setattr(ledger_store, "SNAPSHOT_EVERY", 3)
    backend = _FillingBackend(write_checkpoints=False)
    object.__setattr__(model, "_backend", backend)
    with warnings.catch_warnings(), pytest.raises(BaseExceptionGroup) as excinfo:
        warnings.simplefilter("ignore", RuntimeWarning)  # the final snapshot fails too
        await _trainer(model, backend, max_steps=50).train(handle_signals=False)
    leaf, _ = find_leaf(excinfo.value, StateWriteError)
    assert isinstance(leaf, StateWriteError) and leaf.errno == errno.ENOSPC, leaf
    assert str(mounted) in str(leaf)
    assert backend.train_started == backend.step  # nothing started after the failed write
    assert backend.step <= backend.fill_at + 3
    assert [p.name for p in mounted.iterdir() if p.name.endswith(".tmp")] == []  # noqa: ASYNC240
    (mounted / "filler.bin").unlink()
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    _assert_exactly_once(model, backend)


async def test_a_read_only_model_directory_is_a_clear_error(
    model: art.TrainableModel, mounted: Path, autojump_clock: trio.abc.Clock
) -> None:
    backend = RecordingBackend(write_checkpoints=False)
    object.__setattr__(model, "_backend", backend)
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    _remount(mounted, "ro")
    try:
        with pytest.raises(ModelDirectoryError) as excinfo:
            await _trainer(model, backend, max_steps=2).train(handle_signals=False)
        assert excinfo.value.errno == errno.EROFS
        message = str(excinfo.value)
        assert str(mounted) in message and "writable" in message
        # The message as written, not OSError's "[Errno 30] ...: '<directory>'" around it.
        assert message.startswith("cannot create or open") and message.endswith("base_path")
        assert backend.step == 2
        # A model directory to be created under a read-only directory: the same, naming
        # the directory that could not be made, not the lock file inside it.
        ro_model = trainable_model(
            name="m2", project="p", base_model="b", base_path=str(mounted / "under")
        )
        with pytest.raises(ModelDirectoryError, match="writable") as created:
            await _trainer(ro_model, backend, max_steps=1).train(handle_signals=False)
        assert str(created.value).startswith(f"cannot create or open {mounted / 'under'} (")
    finally:
        _remount(mounted, "rw")
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    assert backend.step == 4
    _assert_exactly_once(model, backend)


# == beyond: the wall clock going backwards ===================================================


async def test_a_wall_clock_going_backwards_changes_nothing_resume_depends_on(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """time.time() steps back an hour at every call (an NTP step, a VM restored): the run
    and its resume go on; only the loop's monotonic clock is used for timing."""
    import time as time_module

    now = [time_module.time()]

    def backwards() -> float:
        now[0] -= 3600.0
        return now[0]

    monkeypatch.setattr(time_module, "time", backwards)
    await _trainer(model, backend, max_steps=4).train(handle_signals=False)
    await _trainer(model, backend, max_steps=4).train(handle_signals=False)
    assert backend.step == 8
    _assert_exactly_once(model, backend)


async def test_a_resume_from_state_jsons_record_alone_is_not_taken_for_a_deleted_snapshot(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """The documented way out of a damaged snapshot (delete it, resume from state.json's
    `_pipeline_trainer`) is a resume, not a snapshot deleted mid-run."""
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    (_out(model) / SIDECAR_FILE).unlink()
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    assert backend.step == 6
    _assert_exactly_once(model, backend)


def test_the_model_directory_deleted_mid_run_under_asyncio(model: art.TrainableModel) -> None:
    """The same under `anyio.run` on asyncio (no trio-asyncio): stopped, written again."""
    backend = _DeletingBackend()
    object.__setattr__(model, "_backend", backend)
    out = _out(model)

    async def run(steps: int) -> None:
        await _trainer(model, backend, max_steps=steps).train(handle_signals=False)

    with pytest.raises(BaseExceptionGroup) as excinfo:
        anyio.run(run, 10, backend="asyncio")
    leaf, _ = find_leaf(excinfo.value, ModelDirectoryLostError)
    assert str(out) in str(leaf) and backend.step == backend.delete_at
    assert _deleted_files_open(out) == []
    backend.delete_at = -1
    anyio.run(run, 3, backend="asyncio")
    assert backend.step == 6
    _assert_exactly_once(model, backend)


def test_a_forked_child_cannot_take_the_lock_its_parent_holds(tmp_path: Path) -> None:
    """The child inherits no lock, and no registry entry either: a RunLock in it is refused
    by the kernel, naming the parent; after the parent releases, the child may take it."""
    lock = RunLock(tmp_path / "m")
    lock.acquire()
    tried_read, tried_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if every expectation holds
        code = 1
        try:
            try:
                RunLock(tmp_path / "m").acquire()
            except RunLockedError as exc:
                refused = f"pid {os.getppid()}" in str(exc)
            else:
                refused = False
            os.write(tried_write, b"t")
            os.read(go_read, 1)  # the parent released
            if refused:
                again = RunLock(tmp_path / "m")
                again.acquire()
                again.release()
                code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(tried_read, 1) == b"t"
        lock.release()
    finally:
        os.write(go_write, b"g")
        _, status = os.waitpid(pid, 0)
        for fd in (tried_read, tried_write, go_read, go_write):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_failing_fsync_of_a_record_is_a_state_write_error_naming_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path, fsync=True)
    state = PipelineState()
    store.write(state)
    _record(store, state, 0)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(ledger_files.os, "fsync", failing)
    with pytest.raises(StateWriteError) as excinfo:
        _record(store, state, 1)
    monkeypatch.undo()
    assert excinfo.value.errno == errno.EIO
    assert str(tmp_path / JOURNAL_FILE) in str(excinfo.value)
    # What the failed record carried goes into the next one: nothing is lost.
    _record(store, state, 2)
    store.close()
    again = StateStore(tmp_path).read()
    assert again is not None and again.ledger.watermark == 3


async def test_deleted_then_locked_by_another_run_before_this_one_noticed(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """The directory deleted and a new run started in it before this one's next write: this
    one stops without writing a byte over the other run's state."""
    out = _out(model)
    original_train = backend.train
    intruder = RunLock(out)

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        result = await original_train(model, groups, **kwargs)
        if backend.step == 2:
            shutil.rmtree(out)
            intruder.acquire()  # a new lock file, locked by "another run"
        return result

    backend.train = train  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings(), pytest.raises(BaseExceptionGroup) as excinfo:
            warnings.simplefilter("ignore", RuntimeWarning)
            await _trainer(model, backend, max_steps=10).train(handle_signals=False)
        leaf, _ = find_leaf(excinfo.value, ModelDirectoryLostError)
        message = str(leaf)
        assert "could not write the run's resume state there again" in message
        assert "another art_trio run is training" in message
        assert backend.step == 2
        assert not (out / SIDECAR_FILE).exists() and not (out / JOURNAL_FILE).exists()
    finally:
        intruder.release()
