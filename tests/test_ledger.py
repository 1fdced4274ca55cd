"""The resume ledger and its store: what is resolved, and how it survives crashes.

What a user may rely on:

- `scenario_offset` (the watermark) only counts resolved scenarios: every index below it was
  trained or discarded with a reason; resolved indices above it are listed;
- the batch handed to `backend.train` is recorded before the call and settled on resume
  against the backend's step (trained: resolved; not trained: rolled again);
- state.json keeps the reference's `_pipeline_trainer` key and fields, next to ART's own keys;
- writes are atomic: a kill at any moment leaves a readable state at least as new as the
  last write that returned; a torn state.json (ART rewrites it in place) is repaired from
  art_trio's sidecar on resume.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.plumbing.progress import PIPELINE_STATE_KEY
from art_trio.resume.files import SIDECAR_FILE
from art_trio.resume.scenarios import PendingBatch, ScenarioLedger
from art_trio.resume.state import PipelineState
from art_trio.resume.store import StateStore
from tests.crash_harness import Child, Harness, expected_ledger
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios

#: The fields ART's trainer writes under `_pipeline_trainer` (art/pipeline_trainer/trainer.py).
REFERENCE_FIELDS = {
    "scenario_offset",
    "total_scenarios_consumed",
    "training_step",
    "last_eval_step",
    "completed_eval_steps",
}

# -- ScenarioLedger ----------------------------------------------------------------------------


def test_watermark_advances_over_a_contiguous_resolved_prefix_only() -> None:
    ledger = ScenarioLedger()
    ledger.resolve(2)
    ledger.resolve(4)
    assert (ledger.watermark, ledger.resolved_above) == (0, {2, 4})
    ledger.resolve(0)
    assert (ledger.watermark, ledger.resolved_above) == (1, {2, 4})
    ledger.resolve(1)
    assert (ledger.watermark, ledger.resolved_above) == (3, {4})
    ledger.resolve(1)  # already below the watermark: nothing changes
    assert (ledger.watermark, ledger.resolved_above) == (3, {4})
    assert [i for i in range(6) if ledger.is_resolved(i)] == [0, 1, 2, 4]


def test_a_begun_batch_is_not_resolved_until_committed() -> None:
    ledger = ScenarioLedger()
    ledger.begin_batch(1, [3, 0, 1])
    assert ledger.pending == PendingBatch(step=1, scenario_indices=[0, 1, 3])
    assert not any(ledger.is_resolved(i) for i in range(4))
    ledger.commit_batch()
    assert ledger.pending is None
    assert (ledger.watermark, ledger.resolved_above) == (2, {3})


@pytest.mark.parametrize(
    "backend_step, trained", [(4, True), (5, True), (3, False)], ids=["done", "later", "not"]
)
def test_settling_a_pending_batch_against_the_backends_step(
    backend_step: int, trained: bool
) -> None:
    ledger = ScenarioLedger(watermark=2)
    ledger.begin_batch(4, [2, 3])
    assert ledger.settle_pending(backend_step) is trained
    assert ledger.pending is None
    assert ledger.is_resolved(2) is trained and ledger.is_resolved(3) is trained
    assert ledger.settle_pending(backend_step) is False  # nothing pending any more


# -- PipelineState ------------------------------------------------------------------------------


def _state(n: int = 5) -> PipelineState:
    state = PipelineState(
        ledger=ScenarioLedger(
            watermark=n, resolved_above={n + 2, n + 5}, pending=PendingBatch(3, [n, n + 1])
        ),
        total_scenarios_consumed=n + 8,
        training_step=2,
        last_eval_step=2,
        completed_eval_steps={0, 2},
        pending_eval_steps={0, 2, 4},
    )
    return state


def test_state_round_trips_through_json() -> None:
    state = _state()
    data = json.loads(json.dumps(state.to_json()))
    assert REFERENCE_FIELDS <= set(data)
    assert data["scenario_offset"] == 5
    again = PipelineState.from_json(data)
    assert again.ledger == state.ledger
    assert again.total_scenarios_consumed == 13
    assert again.training_step == 2
    assert again.last_eval_step == 2
    assert again.completed_eval_steps == {0, 2}
    assert again.pending_eval_steps == {4}  # completed ones are not pending


def test_a_reference_record_alone_resumes_at_its_offset() -> None:
    state = PipelineState.from_json(
        {"scenario_offset": 7, "training_step": 3, "last_eval_step": 0,
         "completed_eval_steps": [0]}
    )
    assert state.ledger == ScenarioLedger(watermark=7)
    assert state.total_scenarios_consumed == 7
    assert state.training_step == 3
    assert state.completed_eval_steps == {0}


def test_resolved_indices_below_the_offset_are_ignored() -> None:
    state = PipelineState.from_json({"scenario_offset": 4, "resolved_scenarios": [1, 3, 6]})
    assert state.ledger.resolved_above == {6}


# -- StateStore ---------------------------------------------------------------------------------


def _tmp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_write_keeps_arts_keys_and_the_reference_record(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"_metrics_builder_state": {"x": 1}}))
    store = StateStore(tmp_path)
    store.write(_state())
    art_state = json.loads((tmp_path / "state.json").read_text())
    assert art_state["_metrics_builder_state"] == {"x": 1}
    assert REFERENCE_FIELDS <= set(art_state[PIPELINE_STATE_KEY])
    mirror = art_state[PIPELINE_STATE_KEY]
    sidecar = json.loads((tmp_path / SIDECAR_FILE).read_text())
    # The same record, but for the completed evals: ART's whole list in the mirror, runs in
    # art_trio's own snapshot (issue 25: a snapshot is not O(evals)).
    assert mirror.pop("completed_eval_steps") == [0, 2]
    assert sidecar.pop("completed_eval_runs") == [[0, 2, 2]]
    assert mirror == sidecar
    assert _tmp_files(tmp_path) == []


def test_read_prefers_the_sidecar_and_is_none_for_a_fresh_directory(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    assert store.read() is None
    store.write(_state(5))
    # ART's trainer (or an older art_trio) rewrote state.json with a coarser record.
    (tmp_path / "state.json").write_text(json.dumps({PIPELINE_STATE_KEY: {"scenario_offset": 1}}))
    state = store.read()
    assert state is not None and state.ledger.watermark == 5


def _appended(store: StateStore, state: PipelineState, *indices: int, step: int) -> None:
    """One step's worth of persistence: resolutions, the next pending batch, one record."""
    state.ledger.resolve_all(indices)
    state.ledger.begin_batch(step, [100 + step])
    state.training_step = step - 1
    store.append(state)


def test_journal_records_are_replayed_on_read(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    _appended(store, state, 0, 1, step=1)
    _appended(store, state, 2, 5, step=2)
    again = StateStore(tmp_path).read()
    assert again is not None
    assert again.ledger == ScenarioLedger(
        watermark=3, resolved_above={5}, pending=PendingBatch(2, [102])
    )
    assert again.training_step == 1


def test_a_journal_record_torn_by_a_kill_is_ignored(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    _appended(store, state, 0, step=1)
    _appended(store, state, 1, step=2)
    journal = store.journal_path
    journal.write_bytes(journal.read_bytes()[:-7])  # the second record, cut mid-line
    again = StateStore(tmp_path).read()
    assert again is not None
    # As after the first record: the second one's train call never started.
    assert again.ledger == ScenarioLedger(watermark=1, pending=PendingBatch(1, [101]))


def test_a_corrupt_journal_record_before_the_last_is_a_clear_error(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    _appended(store, state, 0, step=1)
    _appended(store, state, 1, step=2)
    lines = store.journal_path.read_text().splitlines()
    store.journal_path.write_text("\n".join([lines[0][:-3], lines[1]]) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        StateStore(tmp_path).read()


def test_records_already_in_a_snapshot_are_not_replayed_over_it(tmp_path: Path) -> None:
    """A kill between writing a snapshot and emptying the journal: the old records stay, and
    must not bring back an older pending batch or step."""
    store = StateStore(tmp_path)
    state = PipelineState()
    store.write(state)
    _appended(store, state, 0, step=1)
    _appended(store, state, 1, step=2)
    old_journal = store.journal_path.read_bytes()
    state.ledger.commit_batch()
    state.training_step = 2
    store.write(state)
    assert store.journal_path.read_bytes() == b""  # a snapshot starts a new journal
    store.journal_path.write_bytes(old_journal)  # ... unless the kill came first
    again = StateStore(tmp_path).read()
    assert again is not None
    assert again.ledger.pending is None
    assert again.training_step == 2
    assert again.ledger.is_resolved(102)


def test_a_failed_write_leaves_the_previous_state_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path)
    store.write(_state(5))

    def no_rename(src: Any, dst: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="rename failed"):
        store.write(_state(9))
    monkeypatch.undo()
    state = store.read()
    assert state is not None and state.ledger.watermark == 5
    assert _tmp_files(tmp_path) == []


def test_fsync_makes_the_file_and_its_rename_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync on, the sidecar's data and the directory entry (the rename) are synced."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    StateStore(tmp_path, fsync=True).write(_state())
    assert "file" in synced and "dir" in synced, synced


def test_a_torn_state_json_is_repaired_from_the_sidecar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = StateStore(tmp_path)
    store.write(_state(5))
    art_state = tmp_path / "state.json"
    text = art_state.read_text()
    art_state.write_text(text[: len(text) // 2])  # what a kill during ART's write leaves
    state = store.read()
    assert state is not None and state.ledger.watermark == 5
    repaired = json.loads(art_state.read_text())
    assert repaired[PIPELINE_STATE_KEY]["scenario_offset"] == 5
    assert "unreadable" in caplog.text


def test_an_unreadable_sidecar_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / SIDECAR_FILE).write_text('{"scenario_offset": 3,')
    with pytest.raises(ValueError, match=SIDECAR_FILE):
        StateStore(tmp_path).read()


async def test_a_torn_state_json_is_repaired_when_a_run_resumes(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """ART's model.log reads state.json: resume must not trip over ART's own torn write."""

    def trainer(max_steps: int) -> PipelineTrainer[Any, None]:
        return PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(100), None,
            num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps=max_steps,
            eval_step_0=False,
        )

    await trainer(2).train(handle_signals=False)
    out = Path(model._get_output_dir())
    watermark = json.loads((out / SIDECAR_FILE).read_text())["scenario_offset"]
    art_state = out / "state.json"
    text = art_state.read_text()
    art_state.write_text(text[: len(text) // 3])
    first = [i for call in backend.calls for i in call.scenario_ids]

    await trainer(2).train(handle_signals=False)
    assert backend.step == 4
    second = [i for call in backend.calls for i in call.scenario_ids][len(first):]
    assert min(second) >= watermark
    assert not set(first) & set(second)
    assert PIPELINE_STATE_KEY in json.loads(art_state.read_text())


async def test_a_run_leaves_arts_keys_and_the_reference_record_side_by_side(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """ART's model.log and art_trio both write state.json; neither loses the other's keys."""
    await PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(100), None,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps=3,
        eval_step_0=False,
    ).train(handle_signals=False)
    out = Path(model._get_output_dir())
    art_state = json.loads((out / "state.json").read_text())
    assert "_metrics_builder_state" in art_state  # written by ART's model.log
    record = art_state[PIPELINE_STATE_KEY]
    assert REFERENCE_FIELDS <= set(record)
    sidecar = json.loads((out / SIDECAR_FILE).read_text())
    assert record["scenario_offset"] == sidecar["scenario_offset"] == 6
    assert record["training_step"] == 3


# -- kill -9 during state writes ------------------------------------------------------------


def test_kill_9_during_state_writes_never_leaves_an_unreadable_state(
    harness: Harness, tmp_path: Path
) -> None:
    """A child persists growing states in a loop and is SIGKILLed at random moments; after
    each kill the state reads back whole and at least as new as the last acknowledged write."""
    rng = random.Random(1202)
    store_dir = tmp_path / "store"
    last_ack = 0
    for _ in range(12):
        child = Child(harness, f"write-loop {store_dir}")
        assert child.wait_for("ack", rng.randint(1, 40))
        time.sleep(rng.uniform(0.0, 0.004))
        assert child.kill() == -signal.SIGKILL
        acks = [int(line.split()[1]) for line in child.lines if line.startswith("ack")]
        assert acks[-1] > last_ack
        last_ack = acks[-1]

        state = StateStore(store_dir).read()
        assert state is not None
        n = state.training_step
        assert n is not None and n >= last_ack
        # A whole state n, not a mix of two writes.
        expected = expected_ledger(n)
        assert state.ledger.watermark == expected.watermark
        assert state.ledger.resolved_above == expected.resolved_above
        # ART's state.json stays readable, with the reference's record in it.
        mirror = json.loads((store_dir / "state.json").read_text())[PIPELINE_STATE_KEY]
        assert mirror["scenario_offset"] <= state.ledger.watermark


def test_read_clears_temporary_files_a_killed_write_left_behind(tmp_path: Path) -> None:
    """A kill between creating the temporary file and renaming it leaves the temporary file;
    resume (which reads first) removes them, so crashes do not litter the model directory."""
    store = StateStore(tmp_path)
    store.write(_state(5))
    for name in (f".{SIDECAR_FILE}.k1ll3d.tmp", ".state.json.k1ll3d.tmp"):
        (tmp_path / name).write_text('{"scenario_offset": 9')
    state = store.read()
    assert state is not None and state.ledger.watermark == 5
    assert _tmp_files(tmp_path) == []
