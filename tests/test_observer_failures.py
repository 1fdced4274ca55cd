"""A user observer that raises ends the run, and never between a state change and its fate.

Events are emitted in the middle of the run's state changes (a scenario taken, a group
queued, a batch handed to the backend). An observer raising there, on any event type, at its
first or a later occurrence, must still leave every taken scenario with exactly one fate, and
a resumed run must train each scenario at most once. The mutant at the end (an observer's
exception raised at the emit site, as it used to be) is caught by the same check.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from typing import Any, get_args

import anyio
import art
import pytest

import art_trio.messages.events
from art_trio import AsyncioTaskCancelled, PipelineTrainer, RunEvent, ScenarioSettled, StepTrained
from art_trio.messages.events import Observers, RolloutStarted
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory

MAX_STEPS = 4

# The workload returns empty groups on purpose (to reach EmptyGroupReceived).
pytestmark = pytest.mark.filterwarnings(
    "ignore:rollout_fn returned an art.TrajectoryGroup with no trajectories:RuntimeWarning",
    "ignore:no step was trained:RuntimeWarning",
)


class Boom(Exception):
    pass


async def _rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
    i = scenario["i"]
    if i % 6 == 4:
        raise ValueError("a failing rollout")  # ERRORED
    if i % 6 in (1, 5):
        return art.TrajectoryGroup([])  # EmptyGroupReceived
    if i % 6 == 3:
        return art.TrajectoryGroup([trajectory(1.0), trajectory(1.0)])  # zero variance
    return await asyncio_rollout(model, scenario, config)


async def _eval(model: Any, step: int, config: Any) -> list[art.Trajectory]:
    return [trajectory(0.5)]


def _trainer(model: Any, backend: Any, max_steps: int) -> PipelineTrainer[Any, None]:
    return PipelineTrainer(
        model, backend, _rollout, scenarios(60), None, _eval,
        num_rollout_workers=4, min_batch_size=2, max_batch_size=2, max_steps=max_steps,
        queue_maxsize=1, eval_every_n_steps=1,
    )


class _Recorder:
    """Registered before the raising observer: hears every event, the fatal one included."""

    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    def __call__(self, event: RunEvent) -> None:
        self.events.append(event)


class _RaiseOn:
    def __init__(self, kind: type, occurrence: int) -> None:
        self.kind, self.occurrence, self.seen = kind, occurrence, 0

    def __call__(self, event: RunEvent) -> None:
        if isinstance(event, self.kind):
            self.seen += 1
            if self.seen == self.occurrence:
                raise Boom(f"observer raised on {self.kind.__name__} #{self.occurrence}")


def _leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _leaf(inner, kind)
            if found is not None:
                return found
    return None


async def _run_with_raising_observer(
    model: art.TrainableModel, backend: RecordingBackend, kind: type, occurrence: int
) -> str | None:
    """Run until the observer raises, then resume; None if every guarantee held, else what
    broke."""
    trainer = _trainer(model, backend, MAX_STEPS)
    recorder = _Recorder()
    trainer.add_observer(recorder)
    trainer.add_observer(_RaiseOn(kind, occurrence))
    try:
        await trainer.train(handle_signals=False)
    except Exception as exc:
        if _leaf(exc, Boom) is None:
            return f"train() raised {exc!r}, not the observer's error"
    else:
        return f"the run never emitted {kind.__name__} #{occurrence}"
    taken = {e.scenario_index for e in recorder.events if isinstance(e, RolloutStarted)}
    fates = collections.Counter(
        e.scenario_index for e in recorder.events if isinstance(e, ScenarioSettled)
    )
    twice = sorted(i for i, n in fates.items() if n > 1)
    unsettled = sorted(taken - set(fates))
    if twice or unsettled:
        return f"settled twice: {twice}; taken with no fate: {unsettled}"
    stats = trainer.statistics()
    if stats.taken != sum(fates.values()):
        return f"statistics count {stats.taken} taken, the events {sum(fates.values())} fates"

    resumed = _trainer(model, backend, MAX_STEPS + 2)
    await resumed.train(handle_signals=False)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    again = sorted(i for i, n in collections.Counter(trained).items() if n > 1)
    if again:
        return f"trained twice across the failure and the resume: {again}"
    return None


async def _emitted_by_a_clean_run(
    model: art.TrainableModel, backend: RecordingBackend
) -> set[type]:
    trainer = _trainer(model, backend, MAX_STEPS)
    recorder = _Recorder()
    trainer.add_observer(recorder)
    await trainer.train(handle_signals=False)
    return {type(e) for e in recorder.events}


#: The event types this workload emits (checked below, so the list cannot rot).
REACHED = [
    kind
    for kind in get_args(RunEvent)
    if kind.__name__ not in {"Resized", "Collapsed", "RolloutGivenBack", "Stalled"}
]


async def test_the_workload_reaches_every_listed_event_type(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any
) -> None:
    emitted = await _emitted_by_a_clean_run(model, backend)
    assert set(REACHED) <= emitted, sorted(k.__name__ for k in set(REACHED) - emitted)


#: Emitted once a run: raising on a later occurrence cannot be tried.
ONCE = {"ChannelClosed"}


@pytest.mark.parametrize(
    ("kind", "occurrence"),
    [
        pytest.param(kind, n, id=f"{kind.__name__}-{n}")
        for kind in REACHED
        for n in (1, 2)
        if n == 1 or kind.__name__ not in ONCE
    ],
)
async def test_an_observer_raising_leaves_every_taken_scenario_one_fate(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: Any,
    kind: type,
    occurrence: int,
) -> None:
    broken = await _run_with_raising_observer(model, backend, kind, occurrence)
    assert broken is None, broken


def _emit_raising_at_the_site(self: Observers, event: RunEvent) -> None:
    """The mutant: the observer's exception leaves `emit` at the emit site."""
    for handler in self._routes.get(type(event), ()):
        handler(event)
    for callback in self._users:
        try:
            callback(event)
        except Exception as exc:
            if self.failure is None or self.failure is exc:
                self.failure = exc
                raise


#: Where an observer raising at the emit site used to leave a taken scenario without a fate.
FATE_SITES = ["RolloutStarted", "RolloutEnded", "GroupQueued", "GroupReceived", "BatchTaken",
              "TrainCallStarted"]


@pytest.mark.parametrize("name", FATE_SITES)
async def test_the_check_catches_an_observer_raising_at_the_emit_site(
    model: art.TrainableModel,
    backend: RecordingBackend,
    autojump_clock: Any,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    monkeypatch.setattr(art_trio.messages.events.Observers, "emit", _emit_raising_at_the_site)
    kind = getattr(art_trio.messages.events, name)
    broken = await _run_with_raising_observer(model, backend, kind, 1)
    assert broken is not None, f"the mutant raising on {name} was not caught"


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_or_system_exit_from_an_observer_is_raised_once_by_train(
    model: art.TrainableModel, backend: RecordingBackend, loop: str,
    kind: type[BaseException],
) -> None:
    """It ends the run as an observer's error does (state saved, every taken scenario one
    fate) and `train()` raises it as itself; the program that catches it goes on. Raised on
    in an asyncio task it would also have ended `anyio.run`'s loop a second time."""

    def observer(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 1:
            raise kind("from an observer")

    async def main() -> str:
        trainer = _trainer(model, backend, MAX_STEPS)
        trainer.add_observer(observer)
        try:
            await trainer.train(handle_signals=False)
        except kind as exc:
            return str(exc)
        return "train() returned"

    assert anyio.run(main, backend=loop) == "from an observer"  # and nothing else raised
    assert len(backend.calls) == 1
    resumed = _trainer(model, backend, MAX_STEPS)
    anyio.run(functools.partial(resumed.train, handle_signals=False), backend=loop)
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert len(trained) == len(set(trained)) and len(backend.calls) == 1 + MAX_STEPS


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_an_observer_raising_asyncio_cancelled_error_fails_the_run_naming_it(
    model: art.TrainableModel, backend: RecordingBackend, loop: str
) -> None:
    """Nothing cancels a synchronous observer, so its CancelledError is its own: under
    asyncio it read as the run being cancelled, and `train()` returned as if done."""

    def observer(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 1:
            raise asyncio.CancelledError("from an observer")

    trainer = _trainer(model, backend, MAX_STEPS)
    trainer.add_observer(observer)
    with pytest.RaisesGroup(
        pytest.RaisesExc(AsyncioTaskCancelled, match=r"observer raised asyncio.CancelledError")
    ):
        anyio.run(functools.partial(trainer.train, handle_signals=False), backend=loop)
    assert len(backend.calls) == 1
