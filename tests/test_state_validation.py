"""Issue 19, item 9: hand-edited or foreign resume state is refused with an error that names
the file, what is wrong and what to do, and is never applied.

Before: non-UTF-8 bytes, a `{}` or `[1,2,3]` journal line, a non-integer offset or a pending
batch without indices raised bare UnicodeDecodeError / KeyError / TypeError / ValueError
without a path; another run's sidecar copied in made scenarios 6-23 skip silently; a
negative offset re-trained 0-3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.messages.errors import ForeignStateError, StateFileError
from art_trio.plumbing.progress import PIPELINE_STATE_KEY
from art_trio.resume.files import JOURNAL_FILE, SIDECAR_FILE
from art_trio.resume.state import PipelineState
from art_trio.resume.store import StateStore
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios


def _trainer(
    model: art.TrainableModel, backend: RecordingBackend, source: Any = None, **kwargs: Any
) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 2, "min_batch_size": 2, "max_batch_size": 2,
        "eval_step_0": False, "log_interval_seconds": 3600.0,
    }
    options.update(kwargs)
    return PipelineTrainer(
        model, backend, asyncio_rollout, scenarios(100) if source is None else source, None,
        **options,
    )


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            try:
                return _find(sub, kind)
            except LookupError:
                continue
    raise LookupError(f"no {kind.__name__} in {exc!r}")


def _snapshot_with_journal(directory: Path) -> StateStore:
    """A snapshot at watermark 4 and two journal records after it."""
    store = StateStore(directory)
    state = PipelineState()
    state.ledger.resolve_all(range(4))
    store.write(state)
    for step in (1, 2):
        state.ledger.begin_batch(step, [4 + 2 * step, 5 + 2 * step])
        state.training_step = step - 1
        store.append(state)
    store.close()
    return store


# -- malformed files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, what",
    [
        (b"{}", "integer `seq`"),
        (b"[1,2,3]", "integer `seq`"),
        (b'{"seq": "7"}', "integer `seq`"),
        (b"\xff\xfe not utf-8", "UTF-8"),
        (b'{"seq": 9, "resolved": [1, "x"]}', "`resolved`"),
        (b'{"seq": 9, "pending_batch": {"step": 3}}', "`scenario_indices`"),
        (b'{"seq": 9, "training_step": -2}', "`training_step`"),
    ],
    ids=["empty-object", "list", "string-seq", "non-utf8", "bad-resolved", "no-indices",
         "negative-step"],
)
def test_a_malformed_journal_line_names_the_file_line_and_what_to_do(
    tmp_path: Path, line: bytes, what: str
) -> None:
    store = _snapshot_with_journal(tmp_path)
    journal = store.journal_path
    lines = journal.read_bytes().splitlines()
    epoch = json.loads(lines[0])["epoch"]
    line = line.replace(b'{"seq": 9', b'{"epoch": "%s", "seq": 9' % epoch.encode())
    journal.write_bytes(b"\n".join([lines[0], line, lines[1]]) + b"\n")
    with pytest.raises(StateFileError) as excinfo:
        StateStore(tmp_path).read()
    message = str(excinfo.value)
    assert str(journal) in message and "line 2" in message, message
    assert what in message, message
    assert "delete it" in message  # what to do


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("scenario_offset", "3", "`scenario_offset`"),
        ("scenario_offset", 2.5, "`scenario_offset`"),
        ("scenario_offset", True, "`scenario_offset`"),
        ("scenario_offset", -4, "`scenario_offset`"),
        ("resolved_scenarios", {"7": 1}, "`resolved_scenarios`"),
        ("pending_batch", {"step": 3}, "`scenario_indices`"),
        ("pending_batch", [3, [1, 2]], "`pending_batch`"),
        ("completed_eval_steps", [0, None], "`completed_eval_steps`"),
    ],
)
def test_a_malformed_snapshot_field_names_the_file_and_field(
    tmp_path: Path, field: str, value: Any, what: str
) -> None:
    StateStore(tmp_path).write(PipelineState())
    sidecar = tmp_path / SIDECAR_FILE
    data = json.loads(sidecar.read_text())
    data[field] = value
    sidecar.write_text(json.dumps(data))
    with pytest.raises(StateFileError) as excinfo:
        StateStore(tmp_path).read()
    message = str(excinfo.value)
    assert str(sidecar) in message and what in message, message
    assert "resume=False" in message


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"scenario_offset": 3,'],
    ids=["non-utf8", "not-an-object", "torn"],
)
def test_an_unreadable_sidecar_names_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / SIDECAR_FILE).write_bytes(content)
    with pytest.raises(StateFileError, match=str(tmp_path / SIDECAR_FILE)):
        StateStore(tmp_path).read()


def test_a_malformed_reference_record_in_state_json_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({PIPELINE_STATE_KEY: [1, 2, 3]}))
    with pytest.raises(StateFileError, match="state.json key '_pipeline_trainer'"):
        StateStore(tmp_path).read()
    (tmp_path / "state.json").write_text(
        json.dumps({PIPELINE_STATE_KEY: {"scenario_offset": -4}})
    )
    with pytest.raises(StateFileError, match="non-negative"):
        StateStore(tmp_path).read()


def test_journal_records_without_their_snapshot_are_refused(tmp_path: Path) -> None:
    """Records hold only what changed since their snapshot: alone they would forget (and
    train again) everything before it."""
    _snapshot_with_journal(tmp_path)
    (tmp_path / SIDECAR_FILE).unlink()
    (tmp_path / "state.json").unlink()
    with pytest.raises(StateFileError, match=JOURNAL_FILE):
        StateStore(tmp_path).read()


async def test_a_negative_offset_is_refused_by_train_and_nothing_is_trained(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    sidecar = Path(model._get_output_dir()) / SIDECAR_FILE
    data = json.loads(sidecar.read_text())
    data["scenario_offset"] = -4
    sidecar.write_text(json.dumps(data))
    with pytest.raises(StateFileError, match="scenario_offset"):
        await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    assert backend.step == 2


# -- foreign state -------------------------------------------------------------------------


async def test_another_runs_state_copied_in_is_refused(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: trio.abc.Clock,
    tmp_path: Path,
) -> None:
    """The snapshot of another model's run (12 steps in) copied into this model's directory:
    it used to make this run skip those scenarios silently."""
    elsewhere = tmp_path / "other-model"
    other = StateStore(elsewhere, identity={"model": "other", "project": "p"})
    state = PipelineState()
    state.ledger.resolve_all(range(6, 24))
    other.write(state)
    out = Path(model._get_output_dir())
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
    shutil.copy(elsewhere / SIDECAR_FILE, out / SIDECAR_FILE)
    with pytest.raises(ForeignStateError) as excinfo:
        await _trainer(model, backend, max_steps=2).train(handle_signals=False)
    message = str(excinfo.value)
    assert str(out / SIDECAR_FILE) in message and "'other'" in message and "'m'" in message
    assert backend.calls == []


async def test_a_resume_given_another_scenario_source_is_refused(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    shuffled = scenarios(100)[::-1]
    with pytest.raises(BaseExceptionGroup) as excinfo:
        await _trainer(model, backend, source=shuffled, max_steps=3).train(handle_signals=False)
    error = _find(excinfo.value, ForeignStateError)
    assert "scenario 0" in str(error) and SIDECAR_FILE in str(error)
    assert backend.step == 3  # nothing trained from the other source
    # The same source resumes.
    await _trainer(model, backend, max_steps=3).train(handle_signals=False)
    assert backend.step == 6
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained))


async def test_a_source_of_objects_without_a_stable_form_is_not_checked(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """Scenarios that are plain objects (repr with an address) cannot be fingerprinted: the
    check is skipped, never guessed."""

    class Scenario:
        def __init__(self, i: int) -> None:
            self.i = i
            self.metadata = {"scenario_id": i}

        def __getitem__(self, key: str) -> Any:
            return getattr(self, key)

    await _trainer(model, backend, source=[Scenario(i) for i in range(50)], max_steps=2).train(
        handle_signals=False
    )
    await _trainer(model, backend, source=[Scenario(i) for i in range(50)], max_steps=2).train(
        handle_signals=False
    )
    assert backend.step == 4
