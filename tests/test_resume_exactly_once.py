"""Resume exactly once: a run killed at any moment neither skips nor repeats a scenario.

The ledger (ledger.py) keeps a watermark (`scenario_offset`) below which every scenario is
resolved, the resolved indices above it, and the batch handed to `backend.train`, written
before the call. On resume a pending batch whose step the backend reports as done counts as
trained; otherwise its scenarios are rolled again.

The main test kills a real training process with SIGKILL at random moments (through
tests/crash_harness.py) and resumes it until `total_steps`; the others set up the ledger's
cases directly.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import art
import pytest
import trio
import trio_asyncio

from art_trio import PipelineTrainer, ScenarioSourceClosed, StepTrained
from art_trio.plumbing.progress import PIPELINE_STATE_KEY
from art_trio.resume.files import SIDECAR_FILE
from art_trio.resume.store import StateStore
from tests.crash_harness import TRAINED_LOG, Child, Harness, read_trained
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios


def _model_dir(run_dir: Path) -> Path:
    return run_dir / ".art" / "p" / "models" / "crash"


def test_kill_9_at_random_moments_then_resume_trains_each_scenario_exactly_once(
    harness: Harness, tmp_path: Path
) -> None:
    total_steps = 50
    rng = random.Random(20261202)
    run_dir = tmp_path / "run"
    kills = 0
    runs = 0
    started = time.monotonic()
    while kills < 12:
        runs += 1
        assert runs <= 40, "children keep finishing before they are killed"
        child = Child(harness, f"train {run_dir} {total_steps} {rng.randrange(10**6)}")
        moment = rng.random()
        if moment < 0.2:
            # During start-up and resume (reading and settling the ledger).
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            child.wait_for("started")
            # After a few durable steps, then a random few milliseconds: anywhere in a
            # rollout, a state write, backend.train or model.log.
            child.wait_for("step", rng.randint(0, 3))
            time.sleep(rng.uniform(0.0, 0.02))
        code = child.kill()
        kills += code == -signal.SIGKILL
        assert code in (0, -signal.SIGKILL), (code, child.lines)
        if any(line.startswith("done") for line in child.lines):
            pytest.fail(f"a run finished all {total_steps} steps before {kills} kills")

    # Leave the final run some steps of its own (a budget check on the kill schedule).
    assert len(read_trained(run_dir / TRAINED_LOG)) < total_steps - 10
    final = Child(harness, f"train {run_dir} {total_steps} {rng.randrange(10**6)}")
    assert not final.wait_for("never"), final.lines
    assert final.exit_code == 0, final.lines
    done = [line for line in final.lines if line.startswith("done")]
    assert len(done) == 1, final.lines
    _, step, counters_json = done[0].split(" ", 2)
    assert int(step) == total_steps
    counters = json.loads(counters_json)
    assert counters["stale"] == counters["zero_variance"] == counters["errored"] == 0, counters

    records = read_trained(run_dir / TRAINED_LOG)
    assert [r["step"] for r in records] == list(range(1, total_steps + 1))
    trained = [i for r in records for i in r["ids"]]
    duplicates = sorted({i for i in trained if trained.count(i) > 1})
    assert not duplicates, f"scenarios trained more than once: {duplicates}"

    state = StateStore(_model_dir(run_dir)).read()
    assert state is not None
    assert state.ledger.pending is None
    assert state.training_step == total_steps
    below = set(range(state.ledger.watermark))
    # The harness never discards a group, so "resolved" means "trained": the ledger and the
    # backend's durable record agree exactly, and nothing under the watermark was skipped.
    assert below | state.ledger.resolved_above == set(trained)
    art_state = json.loads((_model_dir(run_dir) / "state.json").read_text())
    assert art_state[PIPELINE_STATE_KEY]["scenario_offset"] == state.ledger.watermark
    # A budget for the whole test, not a timing assertion on the trainer.
    assert time.monotonic() - started < 120


# -- the ledger's cases, in process ----------------------------------------------------------


def _trainer(
    model: art.TrainableModel, backend: RecordingBackend, rolled: list[int], **kwargs: Any
) -> PipelineTrainer[Any, None]:
    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        rolled.append(scenario["i"])
        return await asyncio_rollout(model, scenario, config)

    options: dict[str, Any] = {
        "num_rollout_workers": 2,
        "min_batch_size": 2,
        "max_batch_size": 2,
        "eval_step_0": False,
        "max_steps": 2,
    }
    options.update(kwargs)
    return PipelineTrainer(model, backend, rollout, scenarios(10_000), None, **options)


def _write_sidecar(model: art.TrainableModel, data: dict[str, Any]) -> None:
    out = Path(model._get_output_dir())
    out.mkdir(parents=True, exist_ok=True)
    (out / SIDECAR_FILE).write_text(json.dumps(data))


async def test_a_pending_batch_the_backend_trained_counts_as_trained(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    backend.step = 1  # the backend finished step 1; the process died before recording it
    _write_sidecar(
        model,
        {"scenario_offset": 0, "training_step": 0,
         "pending_batch": {"step": 1, "scenario_indices": [0, 1]}},
    )
    rolled: list[int] = []
    await _trainer(model, backend, rolled).train(handle_signals=False)
    assert 0 not in rolled and 1 not in rolled
    assert backend.step == 3
    state = StateStore(model._get_output_dir()).read()
    assert state is not None and state.ledger.is_resolved(0) and state.ledger.is_resolved(1)


async def test_a_pending_batch_the_backend_did_not_train_is_rolled_again(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    _write_sidecar(
        model,
        {"scenario_offset": 0, "training_step": 0,
         "pending_batch": {"step": 1, "scenario_indices": [0, 1]}},
    )
    rolled: list[int] = []
    await _trainer(model, backend, rolled).train(handle_signals=False)
    assert {0, 1} <= set(rolled)
    assert {0, 1} <= {i for call in backend.calls for i in call.scenario_ids}


async def test_resolved_scenarios_above_the_watermark_are_not_rolled_again(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    _write_sidecar(
        model, {"scenario_offset": 3, "training_step": 0, "resolved_scenarios": [4, 6]}
    )
    rolled: list[int] = []
    await _trainer(model, backend, rolled).train(handle_signals=False)
    assert sorted(rolled)[:4] == [3, 5, 7, 8]
    assert not {0, 1, 2, 4, 6} & set(rolled)


async def test_a_state_written_by_arts_trainer_resumes_at_its_offset(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """No sidecar: the reference's `_pipeline_trainer` record in state.json is used."""
    model.merge_state(
        {PIPELINE_STATE_KEY: {"scenario_offset": 5, "total_scenarios_consumed": 5,
                              "training_step": 0, "last_eval_step": 0,
                              "completed_eval_steps": []}}
    )
    rolled: list[int] = []
    await _trainer(model, backend, rolled).train(handle_signals=False)
    assert min(rolled) == 5


async def test_stop_then_resume_repeatedly_trains_each_scenario_once(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """Many graceful stops at random virtual moments: the in-process twin of the kill test."""
    rng = random.Random(7)
    for _ in range(8):
        rolled: list[int] = []
        trainer = _trainer(
            model, backend, rolled, max_steps=None, num_rollout_workers=4, max_batch_size=3,
            max_steps_off_policy=100, shutdown_grace_seconds=rng.choice([0.0, 0.001, None]),
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(trainer.train, handle_signals=False))
            await trio.sleep(rng.uniform(0.0, 0.005))
            trainer.request_stop()
    trained = backend.trained_ids
    assert len(trained) == len(set(trained))
    state = StateStore(model._get_output_dir()).read()
    assert state is not None and state.ledger.pending is None
    assert set(range(state.ledger.watermark)) | state.ledger.resolved_above == set(trained)


def _one_shot_trainer(
    model: art.TrainableModel, backend: RecordingBackend, source: Any, *, resume: bool = True
) -> PipelineTrainer[Any, None]:
    return PipelineTrainer(
        model, backend, asyncio_rollout, source, None, num_rollout_workers=4,
        min_batch_size=2, max_batch_size=3, eval_step_0=False, max_steps_off_policy=100,
        shutdown_grace_seconds=0.0, resume=resume,
    )


async def _stop_at_random_moments(trainer: PipelineTrainer[Any, None], times: int) -> None:
    rng = random.Random(3)
    for _ in range(times):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(trainer.train, handle_signals=False))
            await trio.sleep(rng.uniform(0.0, 0.004))
            trainer.request_stop()


async def _stop_once(pulling: trio.Event, trainer: PipelineTrainer[Any, None]) -> None:
    """Train until the source is `pulling`, then stop."""
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trainer.train, handle_signals=False))
        await pulling.wait()
        trainer.request_stop()


async def _async_generator(source: list[dict[str, Any]]) -> Any:
    for scenario in source:
        yield scenario


async def _held_at_6(
    source: list[dict[str, Any]], pulling: trio.Event, release: asyncio.Event,
    then: Callable[[], None],
) -> Any:
    """`source`, its pull of scenario 6 held until `release`: `pulling` set meanwhile, then
    `then()` (which may raise, as a source failing in that pull)."""
    for i, scenario in enumerate(source):
        if i == 6:
            pulling.set()
            await release.wait()
            then()
        yield scenario


@pytest.mark.parametrize(
    "kind", ["generator", "generator, resume=False", "async generator in the host's loop"]
)
async def test_the_same_trainer_trains_again_from_a_one_shot_source_exactly_once(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock,
    kind: str,
) -> None:
    """A supervisor calling `train()` again on the same trainer, whose scenarios are a
    generator: it cannot be read from its start again, so each call goes on where the last
    left it, and what a stop left in flight or queued is rolled first. With `resume=False`
    (ART's record: a scenario taken is settled, trained or not) nothing is rolled again."""
    source = scenarios(40)
    async with trio_asyncio.open_loop():  # the host's loop: it outlives every train() call
        one_shot = _async_generator(source) if kind.startswith("async") else iter(source)
        trainer = _one_shot_trainer(model, backend, one_shot, resume="False" not in kind)
        await _stop_at_random_moments(trainer, 5)
        await trainer.train(handle_signals=False)  # to the source's end
    trained = backend.trained_ids
    assert len(trained) == len(set(trained))
    if "False" in kind:
        assert 39 in trained and len(trained) < 40  # to the end; the stops' in flight lost
    else:
        assert sorted(trained) == list(range(40))


@pytest.mark.parametrize("resolved", [False, True], ids=["still pulling", "pulled"])
async def test_a_stop_during_an_async_pull_neither_closes_nor_skips_the_source(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock,
    resolved: bool,
) -> None:
    """A stop that comes while an async generator awaits its next scenario (a slow queue, a
    database) leaves the pull running: the generator is not cancelled at its await (which
    closes it for good), and the next `train()` takes the scenario it pulls first. "pulled":
    the scenario was ready before that `train()`, as when the stop cut its way back."""
    pulling, pulled = trio.Event(), trio.Event()
    release = asyncio.Event()

    async with trio_asyncio.open_loop():  # the host's loop: it outlives both train() calls
        one_shot = _held_at_6(scenarios(12), pulling, release, pulled.set)
        trainer = _one_shot_trainer(model, backend, one_shot)
        await _stop_once(pulling, trainer)
        release.set()
        with trio.fail_after(60):  # (virtual seconds) a closed generator pulls nothing
            if resolved:
                await pulled.wait()
            await trainer.train(handle_signals=False)
    trained = backend.trained_ids
    assert sorted(trained) == list(range(12))


async def test_a_source_that_fails_in_a_pull_a_stop_left_running_fails_the_next_call(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """The pull a stop left running ends in the source's own error: the next `train()`
    raises it (in the stages' group, as a source failing during a run does), and trains
    nothing twice."""
    pulling = trio.Event()
    release = asyncio.Event()

    def fail() -> None:
        raise LookupError("the scenario queue went away")

    async with trio_asyncio.open_loop():
        source = _held_at_6(scenarios(12), pulling, release, fail)
        trainer = _one_shot_trainer(model, backend, source)
        await _stop_once(pulling, trainer)
        first = list(backend.trained_ids)
        release.set()
        with trio.fail_after(60), pytest.RaisesGroup(
            pytest.RaisesExc(LookupError, match="queue went away")
        ):
            await trainer.train(handle_signals=False)
    trained = backend.trained_ids
    assert len(trained) == len(set(trained)) and set(first) <= set(trained) <= set(range(6))


async def test_a_pull_cancelled_with_the_last_calls_loop_is_made_again(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """Under trio with no loop of the host's, a pull still waiting when `train()` ends is
    cancelled with that call's loop: an iterator of the user's own class (not a generator,
    so it survives the cancellation) is asked again by the next call, never mistaken for
    asyncio code cancelling itself."""
    pulling = trio.Event()

    class Slow:
        def __init__(self) -> None:
            self.source, self.next, self.released = scenarios(12), 0, False

        def __aiter__(self) -> Slow:
            return self

        async def __anext__(self) -> dict[str, Any]:
            if self.next == len(self.source):
                raise StopAsyncIteration
            if self.next == 6 and not self.released:
                pulling.set()
                await asyncio.Event().wait()
            self.next += 1
            return self.source[self.next - 1]

    slow = Slow()
    trainer = _one_shot_trainer(model, backend, slow)
    await _stop_once(pulling, trainer)
    slow.released = True
    with trio.fail_after(60):
        await trainer.train(handle_signals=False)
    trained = backend.trained_ids
    assert sorted(trained) == list(range(12))


async def test_an_async_generator_closed_with_the_last_calls_loop_is_refused(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """Under trio with no loop of the host's, each `train()` opens and closes its asyncio
    loop, which finalizes the async generators it ran: going on would look like the source's
    end and drop the scenarios never read."""
    trainer = _one_shot_trainer(model, backend, _async_generator(scenarios(40)))
    await _stop_at_random_moments(trainer, 1)
    calls = len(backend.calls)
    with pytest.raises(ScenarioSourceClosed, match="outlives them"):
        await trainer.train(handle_signals=False)
    assert len(backend.calls) == calls
    # The resume state is intact: a new trainer with a new generator trains the rest.
    await _one_shot_trainer(model, backend, _async_generator(scenarios(40))).train(
        handle_signals=False
    )
    trained = backend.trained_ids
    assert sorted(trained) == list(range(40))


def test_under_asyncio_an_async_generator_closed_with_the_last_run_is_refused(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """The same under `anyio.run` on asyncio: each `anyio.run` closes the async generators its
    loop ran, and the error says to keep both calls in one."""
    trainer = _one_shot_trainer(model, backend, _async_generator(scenarios(40)))
    trainer.add_observer(lambda e: isinstance(e, StepTrained) and trainer.request_stop())
    anyio.run(functools.partial(trainer.train, handle_signals=False))
    calls = len(backend.calls)
    with pytest.raises(ScenarioSourceClosed, match=r"one asyncio.run\(\) or anyio.run\(\)"):
        anyio.run(functools.partial(trainer.train, handle_signals=False))
    assert len(backend.calls) == calls >= 1


async def test_the_batch_is_on_disk_before_backend_train_is_called(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: trio.abc.Clock
) -> None:
    """What a process killed inside backend.train leaves: its batch, recorded as pending."""
    seen: list[tuple[int, list[int], Any]] = []
    original_train = backend.train

    async def train(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        on_disk = StateStore(model._get_output_dir()).read()
        assert on_disk is not None
        ids = sorted(g.metadata["scenario_id"] for g in groups)
        seen.append((backend.step + 1, ids, on_disk.ledger.pending))
        assert not any(on_disk.ledger.is_resolved(i) for i in ids)
        return await original_train(model, groups, **kwargs)

    backend.train = train  # type: ignore[method-assign,assignment]
    rolled: list[int] = []
    await _trainer(model, backend, rolled, max_steps=3).train(handle_signals=False)
    assert len(seen) == 3
    for step, ids, pending in seen:
        assert pending is not None
        assert (pending.step, pending.scenario_indices) == (step, ids)
