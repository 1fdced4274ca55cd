"""Issue 32, round four on the trainer core: the run lock, calls from other threads, the
settings groups, the pytest plugin, the Prometheus exporter, hostile state files and the
journal's record size. Each item's test failed before its fix; the attacks on the fixes
(a thread at every phase, a KeyboardInterrupt while threads wait, a lock unlocked under a
run) were written after them.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.config.settings import Evaluation, PipelineSettings, Shutdown, Sizes
from art_trio.messages import errors as art_errors
from art_trio.messages.errors import StateWriteError
from art_trio.resume.lock import RunLock
from art_trio.resume.state import PipelineState
from art_trio.resume.store import StateStore
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios
from tests.errors import find_leaf

REPO = Path(__file__).resolve().parent.parent


def _trainer(model: art.TrainableModel, backend: Any, **kwargs: Any) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 2,
        "min_batch_size": 2,
        "max_batch_size": 2,
        "eval_step_0": False,
        "log_interval_seconds": 3600.0,
    }
    options.update(kwargs)
    return PipelineTrainer(model, backend, asyncio_rollout, scenarios(200), None, **options)


def _out(model: art.TrainableModel) -> Path:
    return Path(model._get_output_dir())


# == 1: the lock holds whatever else the process does with the model directory ===============

_SECOND_RUN = textwrap.dedent(
    """
    import asyncio, json, sys
    import trio, trio_asyncio
    from art_trio import PipelineTrainer, RunLockedError
    from art_trio.plumbing.compat import trainable_model
    from tests.doubles import RecordingBackend, asyncio_rollout, scenarios

    base, out = sys.argv[1], sys.argv[2]
    backend = RecordingBackend()
    model = trainable_model(name="m", project="p", base_model="test-base", base_path=base)
    asyncio.run(model.register(backend))
    trainer = PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(200), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, eval_step_0=False, max_steps=2,
        log_interval_seconds=3600.0,
    )
    try:
        trio.run(lambda: trainer.train(handle_signals=False))
        outcome = "trained"
    except RunLockedError as exc:
        outcome = "refused: " + str(exc)
    ids = [i for call in backend.calls for i in call.scenario_ids]
    with open(out, "w") as f:
        json.dump({"outcome": outcome, "ids": ids}, f)
    """
)


def _second_run(base: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_RUN, str(base), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


async def test_a_copy_of_the_model_directory_during_train_keeps_a_second_run_out(
    model: art.TrainableModel, backend: RecordingBackend, tmp_path: Path
) -> None:
    """A backup of the model directory (a real `shutil.copytree`, which opens and closes the
    lock file) while `backend.train` runs, then a second run started in another process: it
    is refused, and every scenario is trained exactly once."""
    out = _out(model)
    original_train = backend.train
    second: dict[str, Any] = {}

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        if backend.step == 1 and not second:
            shutil.copytree(out, tmp_path / "backup")
            assert (tmp_path / "backup" / "art_trio.lock").exists()
            # Blocking on purpose: the second run starts while this batch is in training.
            second.update(_second_run(tmp_path / ".art", tmp_path / "second.json"))
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    await _trainer(model, backend, max_steps=4).train(handle_signals=False)
    assert second["outcome"].startswith("refused"), second
    assert "another art_trio run is training" in second["outcome"]
    assert second["ids"] == []
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained)) == 8
    assert backend.step == 4


def _unlock(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_UNLCK, 0, 0, 0, 0))


def test_a_lock_lost_anyway_stops_the_run_without_writing_or_taking_it_back(
    tmp_path: Path,
) -> None:
    """If code of this process unlocks the descriptor itself, the next state write finds the
    lock lost: RunLockLostError, nothing written, the lock not taken back (another run may
    have trained and left meanwhile)."""
    lock = RunLock(tmp_path / "m")
    lock.acquire()
    store = StateStore(tmp_path / "m", lock=lock)
    state = PipelineState()
    state.training_step = 3
    store.write(state)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir() if p.is_file()}
    assert lock._fd is not None
    _unlock(lock._fd)
    state.training_step = 4
    with pytest.raises(art_errors.RunLockLostError) as excinfo:
        store.append(state)
    message = str(excinfo.value)
    assert str(tmp_path / "m") in message and "lost its lock" in message
    assert "without writing" in message
    after = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir() if p.is_file()}
    assert after == before
    # Not taken back: another RunLock (standing for another process) gets it.
    other_fd = os.open(lock.path, os.O_RDWR)
    try:
        fcntl.fcntl(
            other_fd,
            fcntl.F_OFD_SETLK,
            struct.pack("hh4xqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0),
        )
    finally:
        os.close(other_fd)
    lock.release()


def test_reading_the_lock_file_in_this_process_does_not_drop_the_lock(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "m")
    lock.acquire()
    (lock.path).read_bytes()  # opens and closes the file
    shutil.copytree(tmp_path / "m", tmp_path / "copy")
    assert lock.check() is None and lock.lost is None
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(lock.path)!r}, os.O_RDWR)\n"
        "try:\n"
        "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except OSError:\n"
        "    print('busy')\n"
        "else:\n"
        "    print('locked')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "busy\n", result
    lock.release()


_ = trio  # the async tests run under pytest-trio


# == 2 and 10: calls from another thread while train() starts up ==============================


class SlowStartBackend(RecordingBackend):
    """`_get_step` (the first thing a run asks its backend) waits until a thread releases it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.entered = threading.Event()
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def _get_step(self, model: Any) -> int:
        if self._wake is None:
            self._wake = (asyncio.get_running_loop(), asyncio.Event())
            self.entered.set()
            await self._wake[1].wait()
        return await super()._get_step(model)

    def release(self) -> None:
        """From any thread: let the waiting `_get_step` return."""
        assert self._wake is not None
        loop, event = self._wake
        try:
            loop.call_soon_threadsafe(event.set)
        except (RuntimeError, AttributeError):
            # A stop ended the run and closed its loop first: nothing waits any more. asyncio's
            # closed loop raises RuntimeError; trio-asyncio's, whose trio token is gone by
            # then, AttributeError.
            pass


def _during_start_up(
    backend: SlowStartBackend, call: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that waits for the start-up to reach the backend, makes `call()` there,
    keeps what it returned or raised, then releases the backend."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        backend.entered.wait()
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001  (the test asserts on it)
            outcome["error"] = exc
        finally:
            backend.release()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


async def _stop_from_a_thread_during_start_up(model: art.TrainableModel) -> None:
    backend = SlowStartBackend()
    object.__setattr__(model, "_backend", backend)
    trainer = _trainer(model, backend, max_steps=5)
    thread, outcome = _during_start_up(backend, trainer.request_stop)
    with anyio.fail_after(120):  # a wedged loop would never get here
        await trainer.train(handle_signals=False)
    thread.join()
    assert "error" not in outcome, outcome
    assert backend.calls == []  # stopped before anything trained


async def test_request_stop_from_a_thread_during_start_up_under_trio(
    model: art.TrainableModel,
) -> None:
    await _stop_from_a_thread_during_start_up(model)


def test_request_stop_from_a_thread_during_start_up_under_asyncio(
    model: art.TrainableModel,
) -> None:
    anyio.run(_stop_from_a_thread_during_start_up, model, backend="asyncio")


async def _resize_from_a_thread_during_start_up(model: art.TrainableModel) -> None:
    backend = SlowStartBackend()
    object.__setattr__(model, "_backend", backend)
    trainer = _trainer(model, backend, max_steps=2, max_batch_size=4)
    thread, outcome = _during_start_up(
        backend, lambda: trainer.resize(num_rollout_workers=7, min_batch_size=3)
    )
    seen: list[tuple[int, int, int]] = []
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        stats = trainer.statistics()
        seen.append((trainer.num_rollout_workers, stats.num_rollout_workers, len(groups)))
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    with anyio.fail_after(120):
        await trainer.train(handle_signals=False)
    thread.join()
    assert "error" not in outcome, outcome
    returned = outcome["result"]
    assert (returned.num_rollout_workers, returned.min_batch_size) == (7, 3)
    # The run started with what the resize returned.
    assert seen and all(workers == 7 and live == 7 and n >= 3 for workers, live, n in seen), seen


async def test_resize_from_a_thread_during_start_up_applies_to_the_run_under_trio(
    model: art.TrainableModel,
) -> None:
    await _resize_from_a_thread_during_start_up(model)


def test_resize_from_a_thread_during_start_up_applies_to_the_run_under_asyncio(
    model: art.TrainableModel,
) -> None:
    anyio.run(_resize_from_a_thread_during_start_up, model, backend="asyncio")


# == 11: a settings group beside flat keywords: one rule =====================================


def test_a_group_beside_flat_keywords_of_the_same_group_merges_where_they_agree(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    def build(**kwargs: Any) -> PipelineSettings:
        return PipelineTrainer(model, backend, asyncio_rollout, [], None, **kwargs).settings

    merged = build(shutdown=Shutdown(max_steps=5), shutdown_grace_seconds=3.0)
    assert (merged.shutdown.max_steps, merged.shutdown.shutdown_grace_seconds) == (5, 3.0)
    # The same value both ways is no conflict.
    assert build(shutdown=Shutdown(max_steps=5), max_steps=5).shutdown.max_steps == 5
    # A group's defaults do not disagree with eval_step_0 (ART 0.5.18's spelling).
    evaluation = build(evaluation=Evaluation(eval_every_n_steps=3), eval_step_0=False)
    assert (evaluation.evaluation.eval_every_n_steps, evaluation.evaluation.eval_at_start) == (
        3,
        False,
    )
    sizes = build(sizes=Sizes(num_rollout_workers=3), min_batch_size=6)
    assert (sizes.sizes.num_rollout_workers, sizes.sizes.min_batch_size) == (3, 6)
    assert sizes.sizes.max_batch_size == 60  # derived from the min given flat
    with pytest.raises(TypeError, match="max_steps is given twice with different values"):
        build(shutdown=Shutdown(max_steps=5), max_steps=6)


@pytest.mark.parametrize("min_batch_size", [1, 8, 50])
def test_sizes_derives_max_batch_size_as_the_flat_keywords_do(
    model: art.TrainableModel, backend: RecordingBackend, min_batch_size: int
) -> None:
    def build(**kwargs: Any) -> PipelineSettings:
        return PipelineTrainer(model, backend, asyncio_rollout, [], None, **kwargs).settings

    flat = build(min_batch_size=min_batch_size)
    grouped = build(sizes=Sizes(min_batch_size=min_batch_size))
    assert grouped.sizes == flat.sizes
    assert Sizes(min_batch_size=min_batch_size).max_batch_size == 10 * min_batch_size
    assert flat.sizes.max_batch_size == 10 * min_batch_size


# == 12: the pytest plugin takes the grouped and pipeline= settings, and names a misspelt key ==

PLUGIN_USER_TESTS = """
import pytest
from art_trio import Sizes
from art_trio.plumbing.compat import PipelineRuntimeConfig


def test_sizes_group(art_trio_pipeline):
    report = art_trio_pipeline.check(
        settings={"sizes": Sizes(num_rollout_workers=3, min_batch_size=2, max_batch_size=2),
                  "max_steps_off_policy": 1},
        source=8, resume=False,
    )
    assert report.case.config.num_rollout_workers == 3
    assert report.case.config.max_batch_size == 2


def test_pipeline_config(art_trio_pipeline):
    report = art_trio_pipeline.check(
        settings={"pipeline": PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2),
                  "max_steps_off_policy": 1},
        source=8, resume=False,
    )
    assert report.case.config.num_rollout_workers == 3
    assert report.case.config.max_batch_size == 20


@pytest.mark.art_trio_pipeline(max_exmples=5)
def test_misspelt_marker_key(art_trio_pipeline):
    art_trio_pipeline.check(settings={}, source=4, resume=False)
"""


def test_the_plugin_takes_grouped_settings_and_names_a_misspelt_marker_key(
    tmp_path: Path,
) -> None:
    from tests.test_testing_plugin import run_pytest

    (tmp_path / "test_user.py").write_text(PLUGIN_USER_TESTS)
    done = run_pytest(tmp_path)
    out = done.stdout + done.stderr
    assert "2 passed" in out and ("1 failed" in out or "1 error" in out), out
    assert "test_misspelt_marker_key" in out
    assert "unknown key 'max_exmples'" in out and "did you mean 'max_examples'" in out, out


# == 13: the Prometheus exporter on a taken port ==============================================


def test_an_exporter_on_a_taken_port_names_it_and_leaves_nothing_attached(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    from art_trio.prometheus import PrometheusExporter

    trainer = _trainer(model, backend)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = PrometheusExporter(trainer, port=port)
        assert trainer._observers.watched
        with pytest.raises(OSError) as excinfo:
            with exporter:
                pass
        message = str(excinfo.value)
        assert f"127.0.0.1:{port}" in message and "port=0" in message, message
        assert excinfo.value.errno == errno.EADDRINUSE
        assert not trainer._observers.watched  # the failed exporter hears nothing
        # The way out works: another port.
        with PrometheusExporter(trainer, port=0) as exporter:
            assert trainer._observers.watched and exporter.port != port
        assert not trainer._observers.watched


# == 14: a small hostile state file is a StateFileError, not a MemoryError ====================


def test_a_small_state_file_expanding_to_a_hundred_million_evals_is_refused(
    tmp_path: Path,
) -> None:
    from art_trio.messages.errors import StateFileError
    from art_trio.resume.files import SIDECAR_FILE

    directory = tmp_path / "m"
    directory.mkdir()
    hostile = PipelineState().to_json(compact=True)
    hostile["completed_eval_runs"] = [[k, 1, 10**6] for k in range(100)]
    path = directory / SIDECAR_FILE
    path.write_text(json.dumps(hostile))
    assert path.stat().st_size < 4000
    with pytest.raises(StateFileError) as excinfo:
        StateStore(directory).read()
    message = str(excinfo.value)
    assert "completed_eval_runs" in message and "100000000 completed evals" in message


# == 15: journal records stay bounded with a backlog of pending evals =========================


def test_journal_records_stay_small_with_a_growing_eval_backlog_and_replay_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eval every step, evals slower than steps: the backlog of pending evals grows to
    hundreds. Each record carries what changed, and a read replays the exact sets."""
    from art_trio.resume import store as ledger_store
    from art_trio.resume.files import JOURNAL_FILE

    monkeypatch.setattr(ledger_store, "SNAPSHOT_EVERY", 10**9)  # the whole journal stays
    directory = tmp_path / "m"
    store, state = StateStore(directory), PipelineState()
    store.write(state)
    for step in range(1, 601):
        state.ledger.resolve_all([2 * step, 2 * step + 1])
        state.ledger.begin_batch(step, [2 * step + 2, 2 * step + 3])
        state.training_step = step
        state.pending_eval_steps.add(step)  # scheduled, as the training stage does
        if step % 3 == 0:  # one in three finishes
            oldest = min(state.pending_eval_steps)
            state.pending_eval_steps.discard(oldest)
            state.complete_eval(oldest)
        if step % 7 == 0:  # one in seven fails: dropped, not completed
            state.pending_eval_steps.discard(max(state.pending_eval_steps))
        if step in (100, 101):  # a full disk: the record is cut back, the next carries it
            _fail_once(monkeypatch)
            with pytest.raises(StateWriteError):
                store.append(state)
            continue
        store.append(state)
        if step % 150 == 0:
            replayed = StateStore(directory).read()
            assert replayed is not None
            assert replayed.completed_eval_steps == state.completed_eval_steps
            assert replayed.pending_eval_steps - replayed.completed_eval_steps == (
                state.pending_eval_steps - state.completed_eval_steps
            )
    assert len(state.pending_eval_steps) > 300  # the backlog the issue saw
    store.close()
    records = (directory / JOURNAL_FILE).read_bytes().splitlines()
    assert max(len(r) for r in records) < 400, max(len(r) for r in records)


def test_journal_records_carry_unsaved_batches_as_changes_and_replay_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints rare or off: up to 64 trained steps are unsaved, and a resume rolls them
    back. Each record carries the batches that joined and how many left, not the whole list
    (which made every record O(64 x batch size)); failed writes, the cap and checkpoints in
    between still replay to the exact list."""
    from art_trio.resume import store as ledger_store
    from art_trio.resume.files import JOURNAL_FILE
    from art_trio.resume.scenarios import MAX_UNSAVED_STEPS

    monkeypatch.setattr(ledger_store, "SNAPSHOT_EVERY", 10**9)  # the whole journal stays
    directory = tmp_path / "m"
    store, state = StateStore(directory), PipelineState()
    store.write(state)
    batch = 32

    def unsaved(s: PipelineState) -> list[tuple[int | None, list[int]]]:
        return [(b.step, b.scenario_indices) for b in s.ledger.unsaved]

    for step in range(1, 301):
        indices = list(range(batch * step, batch * (step + 1)))
        state.ledger.begin_batch(step, indices)
        state.ledger.commit_batch()
        state.training_step = step
        # A checkpoint at steps 40 and 250 only: the list reaches the cap in between.
        state.ledger.note_checkpoint(step, indices, saved=step in (40, 250))
        if step in (100, 101, 250):  # a full disk: the record is cut back, the next carries it
            _fail_once(monkeypatch)
            with pytest.raises(StateWriteError):
                store.append(state)
            continue
        store.append(state)
        if step % 50 == 0 or step in (41, 102, 251):
            replayed = StateStore(directory).read()
            assert replayed is not None
            assert unsaved(replayed) == unsaved(state)
    assert len(state.ledger.unsaved) == 50  # steps 251-300
    store.close()
    records = (directory / JOURNAL_FILE).read_bytes().splitlines()
    # A record after a failed write carries two steps: 2 x 32 resolved and 2 x 32 unsaved
    # indices of ~6 bytes each. The whole list would be MAX_UNSAVED_STEPS x 32 of them.
    assert max(len(r) for r in records) < 2_000 < 6 * batch * MAX_UNSAVED_STEPS


def _fail_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_trio.resume import files as ledger_files

    real = ledger_files.os_write

    def full(fd: int, data: Any) -> int:
        monkeypatch.setattr(ledger_files, "os_write", real)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_files, "os_write", full)


# == attacking the fixes: a thread calling everything at every phase ==========================


def _everything(trainer: PipelineTrainer[Any, None], workers: int) -> tuple[Any, Any]:
    """What a watchdog thread might call: statistics, a resize, statistics again."""
    first = trainer.statistics()
    resized = trainer.resize(num_rollout_workers=workers)
    return first, resized


async def _a_thread_at_every_phase(model: art.TrainableModel) -> None:
    backend = SlowStartBackend()
    object.__setattr__(model, "_backend", backend)
    trainer = _trainer(model, backend, max_steps=50)
    # Before train(): the settings of the next run.
    _, before = await anyio.to_thread.run_sync(_everything, trainer, 3)
    assert before.num_rollout_workers == 3 and not before.running
    # During start-up: applied to the run being built.
    thread, outcome = _during_start_up(backend, lambda: _everything(trainer, 4))
    stepped = anyio.Event()
    seen: dict[str, Any] = {}

    def on_event(event: Any) -> None:
        if type(event).__name__ == "StepTrained" and not stepped.is_set():
            stepped.set()

    trainer.add_observer(on_event)

    async def while_running() -> None:
        await stepped.wait()
        # Running: statistics, a resize, then a stop, all from a thread.
        seen["running"] = await anyio.to_thread.run_sync(_everything, trainer, 5)
        await anyio.to_thread.run_sync(trainer.request_stop)

    async with anyio.create_task_group() as tg:
        tg.start_soon(while_running)
        with anyio.fail_after(120):
            await trainer.train(handle_signals=False)
    thread.join()
    assert "error" not in outcome, outcome
    assert outcome["result"][1].num_rollout_workers == 4
    first, resized = seen["running"]
    assert first.running and first.num_rollout_workers == 4
    assert resized.num_rollout_workers == 5
    steps = backend.step
    assert 1 <= steps < 50  # stopped by the thread's request
    # After: a last view, and a stop that the next train() honours at once.
    after, _ = await anyio.to_thread.run_sync(_everything, trainer, 2)
    assert not after.running and after.steps == steps
    await anyio.to_thread.run_sync(trainer.request_stop)
    backend.entered.clear()
    backend._wake = None
    thread, outcome = _during_start_up(backend, trainer.statistics)
    with anyio.fail_after(120):
        await trainer.train(handle_signals=False)
    thread.join()
    assert "error" not in outcome, outcome
    assert backend.step == steps  # the stop given after the last run: nothing trained
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained))


async def test_a_thread_calling_everything_at_every_phase_under_trio(
    model: art.TrainableModel,
) -> None:
    await _a_thread_at_every_phase(model)


def test_a_thread_calling_everything_at_every_phase_under_asyncio(
    model: art.TrainableModel,
) -> None:
    anyio.run(_a_thread_at_every_phase, model, backend="asyncio")


async def test_a_keyboard_interrupt_in_a_callback_while_a_thread_waits_on_the_loop(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """A rollout raising KeyboardInterrupt ends the run as itself; a thread's statistics()
    call made around it answers (the live run, or its last view), never hangs or raises."""
    calls = 0
    answers: list[Any] = []
    errors: list[BaseException] = []

    async def rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise KeyboardInterrupt
        return await asyncio_rollout(model, scenario, config)

    trainer = PipelineTrainer(
        model,
        backend,
        rollout,
        scenarios(200),
        None,
        num_rollout_workers=2,
        min_batch_size=2,
        max_batch_size=2,
        eval_step_0=False,
        log_interval_seconds=3600.0,
    )

    def watchdog() -> None:
        try:
            answers.append(trainer.statistics())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def on_event(event: Any) -> None:
        if type(event).__name__ == "StepTrained":
            threading.Thread(target=watchdog, daemon=True).start()

    trainer.add_observer(on_event)
    with pytest.raises(KeyboardInterrupt):
        await trainer.train(handle_signals=False)
    # Every thread started has answered or will: the loop is still running here.
    await anyio.to_thread.run_sync(watchdog)
    assert errors == [] and answers and not answers[-1].running
    # The trainer is usable again: a resume trains on, nothing twice.
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained))


# Expected: the run must not write its state once its lock is lost, and says so.
@pytest.mark.filterwarnings("ignore:could not save the resume state after a failure")
async def test_a_run_whose_lock_is_unlocked_under_it_stops_and_a_resume_trains_once(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """Code of the trainer's process unlocking the lock's descriptor (the one way left to lose
    an OFD lock) during backend.train: the next state write stops the run with
    RunLockLostError; a resume trains on, no scenario twice, none skipped."""
    trainer = _trainer(model, backend, max_steps=10)
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        if backend.step == 2:
            lock = trainer._session.keeper._lock  # type: ignore[union-attr]
            assert lock is not None and lock._fd is not None
            _unlock(lock._fd)
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await trainer.train(handle_signals=False)
    leaf, _ = find_leaf(excinfo.value, art_errors.RunLockLostError)
    assert "lost its lock" in str(leaf)
    assert backend.step == 3  # the batch in training finished; nothing trained after it
    backend.train = original_train  # type: ignore[method-assign]
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    assert backend.step == 5
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained))
    state = StateStore(_out(model)).read()
    assert state is not None
    assert set(range(state.ledger.watermark)) <= set(trained)
