"""Issue 25, round three: bounds, accounting and errors on the features added since round two.

What a user may rely on (each is a test below, named after it):

- a trajectory from a policy version the trainer has not published (replayed, a reset
  counter, a bug) stops the run with `FuturePolicyError` ("Trajectory tokens came from a
  future policy", ART 0.5.23's words) under either bound; it is never trained and its
  scenario stays unresolved;
- a `completion_tokens` metric that is infinite, NaN or negative makes its group errored (it
  can never weaken `limit_mean_steps_off_policy`); the mean falls back to the oldest version
  if such a count reaches it anyway;
- counts and sizes are whole numbers: the constructor and `resize()` refuse inf, NaN, 2.5,
  True and strings with a ValueError naming the setting, and a refused `resize()` changes
  nothing; `limit_mean_steps_off_policy=inf` is refused at construction (None is "no bound");
- the batch inside `backend.train` ends in a fate (DROPPED_AT_STOP, with its event) when that
  call ends without a result, by a forced stop or by raising; the ledger keeps it pending and
  a resume trains it exactly once;
- the run's first error wins: an observer raising while the run winds down is logged and
  noted on that error, never raised instead of it;
- `statistics()`, `resize()` and `request_stop()` work from another thread under trio and
  asyncio (the call runs on the loop: one consistent instant), and a loop blocked by a
  callback is reported (`LoopUnresponsive`) instead of hanging the caller;
- observers that stop or resize the run from inside their callback, or raise a
  BaseException, end the run cleanly; extreme `max_steps_off_policy` values run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import art
import pytest

from art_trio import (
    BatchTaken,
    Fate,
    FuturePolicyError,
    LoopUnresponsive,
    PipelineTrainer,
    Resized,
    RunEvent,
    RunStatistics,
    ScenarioSettled,
    StepTrained,
)
from art_trio.policy.batching import Freshness, rollout_problem
from art_trio.policy.freshness import mean_policy_version
from art_trio.resume.store import StateStore
from tests.doubles import (
    RecordingBackend,
    asyncio_rollout,
    scenarios,
    served_trajectory,
    trajectory,
)
from tests.errors import find_leaf
from tests.loops import run_with_deadline

#: How long a run may take before the test calls it a hang.
DEADLINE_S = 120.0

LOOPS = ["trio", "asyncio"]


def _trainer(
    model: art.TrainableModel, backend: Any, rollout_fn: Any = asyncio_rollout,
    n: int = 200, **kwargs: Any,
) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 2,
        "eval_step_0": False, "log_interval_seconds": 3600.0,
    }
    options.update(kwargs)
    return PipelineTrainer(model, backend, rollout_fn, scenarios(n), None, **options)


def _train(trainer: PipelineTrainer[Any, None]) -> Callable[[], Awaitable[None]]:
    return functools.partial(trainer.train, handle_signals=False)


def _fates_add_up(stats: RunStatistics) -> bool:
    return stats.taken == (
        stats.trained + stats.stale + stats.zero_variance + stats.errored
        + stats.dropped_at_stop
    )


class _Settled:
    """An observer collecting every ScenarioSettled (and whatever else it is told to)."""

    def __init__(self) -> None:
        self.settled: list[ScenarioSettled] = []
        self.events: list[RunEvent] = []

    def __call__(self, event: RunEvent) -> None:
        self.events.append(event)
        if isinstance(event, ScenarioSettled):
            self.settled.append(event)

    def check_against(self, stats: RunStatistics) -> None:
        """Every scenario taken ended exactly once, and the events say what the counters say."""
        indices = [e.scenario_index for e in self.settled]
        assert len(indices) == len(set(indices)) == stats.taken, (len(indices), stats)
        assert _fates_add_up(stats), stats
        by_fate = {fate: sum(e.fate is fate for e in self.settled) for fate in Fate}
        assert by_fate[Fate.TRAINED] == stats.trained
        assert by_fate[Fate.DROPPED_AT_STOP] == stats.dropped_at_stop
        assert by_fate[Fate.ERRORED] == stats.errored


# == 1: a trajectory from a future policy ======================================================

BOUNDS = [
    pytest.param({"max_steps_off_policy": 1}, id="hard"),
    pytest.param(
        {"max_steps_off_policy": None, "limit_mean_steps_off_policy": 1.0}, id="mean"
    ),
    pytest.param({"max_steps_off_policy": 1, "limit_mean_steps_off_policy": 1.0}, id="both"),
]


@pytest.mark.parametrize("how", LOOPS)
@pytest.mark.parametrize("bounds", BOUNDS)
@pytest.mark.parametrize("where", ["initial_policy_version", "policy_token_spans"])
def test_a_trajectory_from_a_future_policy_stops_the_run_and_is_never_trained(
    model: art.TrainableModel, backend: RecordingBackend, how: str, bounds: dict[str, Any],
    where: str,
) -> None:
    """It used to count as fresh (a negative age) and train under both bounds, silently."""
    if where == "policy_token_spans" and "limit_mean_steps_off_policy" not in bounds:
        pytest.skip("per-token versions are weighed by the mean bound only")
    future = 6

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        group = await asyncio_rollout(model, scenario, config)
        if scenario["i"] % 5 == 2:  # several, so that one surely completes (none is doomed)
            if where == "initial_policy_version":
                group.trajectories[0].initial_policy_version = future  # replayed
            else:
                group.trajectories[0] = served_trajectory(0.25, step=future)
        return group

    watch = _Settled()
    trainer = _trainer(model, backend, rollout, max_steps=40, **bounds)
    trainer.add_observer(watch)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None, "train() returned normally"
    leaf, notes = find_leaf(exc, FuturePolicyError)
    assert str(leaf).startswith(f"Trajectory tokens came from a future policy: policy={future}")
    found = re.search(r"scenario index (\d+) \[scenario_id=(\d+)\]", str(leaf))
    assert found is not None and found[1] == found[2], str(leaf)
    index = int(found[1])
    assert index % 5 == 2
    assert any("rollout stage" in note for note in notes)
    assert not [i for i in backend.trained_ids if i % 5 == 2]
    stats = trainer.statistics()
    watch.check_against(stats)
    assert [e.fate for e in watch.settled if e.scenario_index == index] == [
        Fate.DROPPED_AT_STOP
    ]
    # Unresolved: a resumed run rolls it again (and stops again while it is still replayed).
    state = StateStore(Path(model._get_output_dir())).read()
    assert state is not None and not state.ledger.is_resolved(index)


def test_the_current_policy_version_is_not_the_future(
    model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """The boundary: a trajectory claiming exactly the trainer's version trains normally."""

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        group = await asyncio_rollout(model, scenario, config)
        group.trajectories[0].initial_policy_version = await model.get_step()
        return group

    trainer = _trainer(model, backend, rollout, max_steps=6, max_steps_off_policy=0)
    assert run_with_deadline("trio", _train(trainer), DEADLINE_S) is None
    assert backend.step == 6


@pytest.mark.parametrize("bad", ["3", 2.5, True])
async def test_a_policy_version_that_is_not_an_int_errors_its_group(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any, bad: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`Trajectory.model_copy(update=...)` does not validate (assignment does, on ART's
    model): a version of the wrong type ended the run with a bare TypeError comparing
    versions."""

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        group = await asyncio_rollout(model, scenario, config)
        if scenario["i"] == 4:
            copied = group.trajectories[1].model_copy(update={"initial_policy_version": bad})
            group = art.TrajectoryGroup([group.trajectories[0], copied])
        return group

    watch = _Settled()
    trainer = _trainer(model, backend, rollout, max_steps=8)
    trainer.add_observer(watch)
    await trainer.train(handle_signals=False)
    assert backend.step == 8 and 4 not in backend.trained_ids
    assert [e.fate for e in watch.settled if e.scenario_index == 4] == [Fate.ERRORED]
    lines = [r.getMessage() for r in caplog.records if "scenario_id=4" in r.getMessage()]
    assert len(lines) == 1 and f"initial_policy_version={bad!r}" in lines[0], lines


# == 2: completion_tokens that no weight can stand for =========================================


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -3, -0.5])
def test_bad_token_counts_never_make_an_old_group_look_fresh(bad: float) -> None:
    """The pure rule: a group holding a 5-step-old trajectory is stale under a mean bound of 1
    whatever the other trajectory's count claims (it was NaN: never stale)."""
    old, fresh = trajectory(0.0), trajectory(1.0)
    old.initial_policy_version, fresh.initial_policy_version = 0, 5
    old.metrics["completion_tokens"], fresh.metrics["completion_tokens"] = 10, bad
    group = art.TrajectoryGroup([old, fresh])
    mean = mean_policy_version(group)
    assert Freshness(None, 1.0).is_stale(0, mean, 5)
    assert mean is not None and math.isfinite(mean) and mean <= 0.0
    problem = rollout_problem(group)
    assert problem is not None and "trajectory 1" in problem and "completion_tokens" in problem
    # A NaN mean (from anywhere) falls back to the group's oldest version too.
    assert Freshness(None, 1.0).is_stale(0, math.nan, 5)


def test_missing_or_zero_token_counts_stay_one_token() -> None:
    """ART 0.5.18 trajectories often have no count: one token, warned (unchanged)."""
    for value in (0, None):
        t = trajectory(1.0)
        if value is None:
            t.metrics.pop("completion_tokens", None)
        else:
            t.metrics["completion_tokens"] = value
        assert rollout_problem(art.TrajectoryGroup([t])) is None


@pytest.mark.parametrize("bad", [math.inf, math.nan, -7])
async def test_a_group_with_a_bad_token_count_is_errored_not_trained(
    model: art.TrainableModel, backend: RecordingBackend, autojump_clock: Any, bad: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`completion_tokens=inf` on a fresh trajectory let a group many versions older than
    `limit_mean_steps_off_policy` through the mean bound (its mean age was NaN)."""
    reached: dict[int, int] = {}  # scenario -> the step when its bad group returned

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
        group = await asyncio_rollout(model, scenario, config)
        if scenario["i"] >= 24 and scenario["i"] % 4 == 0:  # several: any may be doomed
            reached[scenario["i"]] = await model.get_step()
            group.trajectories[0].initial_policy_version = 0  # far behind by now
            group.trajectories[1].metrics["completion_tokens"] = bad
        return group

    watch = _Settled()
    trainer = _trainer(
        model, backend, rollout, max_steps=24, max_steps_off_policy=None,
        limit_mean_steps_off_policy=1.0,
    )
    trainer.add_observer(watch)
    await trainer.train(handle_signals=False)
    assert reached and max(reached.values()) >= 5, reached  # the groups really were old
    assert not set(reached) & set(backend.trained_ids)
    fates = {e.scenario_index: e.fate for e in watch.settled if e.scenario_index in reached}
    # Errored; one that returns after the last step is dropped with the run's end instead.
    assert Fate.ERRORED in fates.values(), fates
    assert set(fates.values()) <= {Fate.ERRORED, Fate.DROPPED_AT_STOP}, fates
    assert backend.step == 24  # bad rollouts now and then do not end the run
    watch.check_against(trainer.statistics())
    for index in fates:
        lines = [
            r.getMessage() for r in caplog.records if f"scenario_id={index}]" in r.getMessage()
        ]
        assert len(lines) == 1 and f"completion_tokens={bad!r}" in lines[0], lines


# == 4, 15: counts are whole numbers; the mean bound is finite =================================

BAD_COUNTS = [math.inf, math.nan, 2.5, True, "4"]
COUNT_SETTINGS = ["num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize"]


@pytest.mark.parametrize("name", [*COUNT_SETTINGS, "max_steps_off_policy", "max_steps"])
@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_the_constructor_refuses_counts_that_are_not_whole_numbers(
    model: art.TrainableModel, backend: RecordingBackend, name: str, bad: object
) -> None:
    kwargs: dict[str, Any] = {name: bad}
    if name == "min_batch_size":
        kwargs["max_batch_size"] = 8
    with pytest.raises(ValueError, match=name):
        _trainer(model, backend, **kwargs)


@pytest.mark.parametrize("name", COUNT_SETTINGS)
@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_resize_refuses_counts_that_are_not_whole_numbers_and_changes_nothing(
    model: art.TrainableModel, backend: RecordingBackend, name: str, bad: object
) -> None:
    trainer = _trainer(model, backend)
    before = trainer.settings
    with pytest.raises(ValueError, match=f"resize: {name} must be a whole number"):
        trainer.resize(**{name: bad})
    assert trainer.settings == before


@pytest.mark.parametrize("how", LOOPS)
def test_resize_to_infinite_workers_during_a_run_is_refused_and_the_run_goes_on(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """`resize(num_rollout_workers=inf)` started workers forever (1.5 GB in 25 s), and
    `max_batch_size=inf` ended the run with a TypeError."""
    refused: list[str] = []
    trainer = _trainer(model, backend, max_steps=8)

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 2:
            for name in ("num_rollout_workers", "max_batch_size", "min_batch_size"):
                try:
                    trainer.resize(**{name: math.inf})
                except ValueError as exc:
                    refused.append(str(exc))
            try:
                trainer.resize(num_rollout_workers=2.5)
            except ValueError as exc:
                refused.append(str(exc))

    trainer.add_observer(observe)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    assert len(refused) == 4 and all("nothing was changed" in r for r in refused), refused
    assert backend.step == 8
    stats = trainer.statistics()
    assert stats.num_rollout_workers == 4 and stats.max_batch_size == 2


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_an_infinite_mean_bound_is_refused_at_construction(
    model: art.TrainableModel, backend: RecordingBackend, bad: float
) -> None:
    """`limit_mean_steps_off_policy=inf` was accepted, then train() died with a bare
    OverflowError. ART 0.5.23 accepts it too and fails the same way (math.ceil(inf) sizing
    its queue), so no working program passes it; None is the one spelling of "no bound"."""
    with pytest.raises(ValueError, match="limit_mean_steps_off_policy must be"):
        _trainer(model, backend, limit_mean_steps_off_policy=bad)
    with pytest.raises(ValueError, match="pass None"):
        _trainer(model, backend, limit_mean_steps_off_policy=math.inf)


@pytest.mark.parametrize("how", LOOPS)
@pytest.mark.parametrize(
    "bounds",
    [
        {"max_steps_off_policy": 0},
        {"max_steps_off_policy": 10**9},
        {"max_steps_off_policy": sys.maxsize},
        {"max_steps_off_policy": None, "limit_mean_steps_off_policy": 0.0},
        {"max_steps_off_policy": None, "limit_mean_steps_off_policy": 1e300},
    ],
    ids=["hard-0", "hard-1e9", "hard-maxsize", "mean-0", "mean-1e300"],
)
def test_extreme_staleness_bounds_run(
    model: art.TrainableModel, backend: RecordingBackend, how: str, bounds: dict[str, Any]
) -> None:
    """0 is strictly on-policy; huge bounds behave as no bound (the channel's capacity is
    huge, which costs nothing until groups fill it)."""
    trainer = _trainer(model, backend, max_steps=6, **bounds)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    assert backend.step == 6
    if 0 in bounds.values():
        assert all(
            v == call.step - 1 for call in backend.calls for v in call.initial_versions
        ), [c.initial_versions for c in backend.calls]


# == 6: the batch inside backend.train when that call ends without a result ===================


class _EnteringBackend(RecordingBackend):
    """Says when `backend.train` is entered (an anyio Event of the trainer's loop)."""

    entered: anyio.Event | None = None
    hold_from_step: int | None = None

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        if self.hold_from_step is not None and self.step + 1 >= self.hold_from_step:
            self.hold_train = True
        if self.entered is not None:
            self.entered.set()
        await super().before_train(groups)


@pytest.mark.parametrize("how", LOOPS)
def test_a_forced_stop_inside_backend_train_gives_the_batch_a_fate_and_resume_trains_it_once(
    model: art.TrainableModel, how: str
) -> None:
    """The batch was lost from the accounting: taken exceeded the fates by the batch size,
    and no ScenarioSettled was emitted for it."""
    backend = _EnteringBackend()
    backend.hold_from_step = 3
    object.__setattr__(model, "_backend", backend)
    watch = _Settled()
    trainer = _trainer(model, backend, max_steps=10)
    trainer.add_observer(watch)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(_train(trainer))
            while True:
                backend.entered = anyio.Event()
                await backend.entered.wait()
                if backend.hold_train:
                    break
            trainer.request_stop(force=True)

    assert run_with_deadline(how, main, DEADLINE_S) is None
    stats = trainer.statistics()
    watch.check_against(stats)
    held = [e for e in watch.events if isinstance(e, BatchTaken)][-1]
    assert held.step == 3 and backend.step == 2
    in_batch = _batch_fates(model, watch)
    assert len(in_batch) == held.batch_size == 2
    assert all(e.fate is Fate.DROPPED_AT_STOP and not e.queued for e in in_batch)
    assert trainer.last_counters is not None and trainer.last_counters.taken == stats.taken

    # Resume: the held batch was never trained (the step did not advance), so it is rolled
    # and trained again, once.
    backend.hold_from_step, backend.hold_train = None, False
    resumed = _trainer(model, backend, max_steps=4)
    assert run_with_deadline(how, _train(resumed), DEADLINE_S) is None
    trained = backend.trained_ids
    assert len(trained) == len(set(trained)), "a scenario was trained twice"
    assert {e.scenario_index for e in in_batch} <= set(trained)


def _batch_fates(model: art.TrainableModel, watch: _Settled) -> list[ScenarioSettled]:
    """The fates of the batch the ledger keeps pending (the one `backend.train` held)."""
    state = StateStore(Path(model._get_output_dir())).read()
    assert state is not None and state.ledger.pending is not None
    pending = set(state.ledger.pending.scenario_indices)
    return [e for e in watch.settled if e.scenario_index in pending]


class _FailingBackend(RecordingBackend):
    class Failed(Exception):
        pass

    async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
        if self.step + 1 == 3:
            await asyncio.sleep(0)
            raise self.Failed("the trainer host went away")
        return await super().train(model, groups, **kwargs)


@pytest.mark.parametrize("how", LOOPS)
def test_backend_train_raising_gives_its_batch_a_fate(
    model: art.TrainableModel, how: str
) -> None:
    backend = _FailingBackend()
    object.__setattr__(model, "_backend", backend)
    watch = _Settled()
    trainer = _trainer(model, backend, max_steps=10)
    trainer.add_observer(watch)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    find_leaf(exc, _FailingBackend.Failed)
    stats = trainer.statistics()
    watch.check_against(stats)
    batch = [e for e in watch.events if isinstance(e, BatchTaken)][-1]
    in_batch = _batch_fates(model, watch)
    assert batch.step == 3 and len(in_batch) == batch.batch_size
    assert all(e.fate is Fate.DROPPED_AT_STOP and not e.queued for e in in_batch)


class _LogFails(Exception):
    pass


@pytest.mark.parametrize("how", LOOPS)
def test_a_batch_trained_but_not_logged_is_counted_once_on_resume(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """`backend.train` returned but `model.log` raised: this run cannot count the batch as
    trained (DROPPED_AT_STOP, pending in the ledger); a resume sees the backend's step and
    counts it as trained, without training it again."""
    original_log = model.log

    async def log(trajectories: Any, split: str = "val", **kwargs: Any) -> None:
        if split == "train" and kwargs.get("step") == 3:
            raise _LogFails("the metrics store is full")
        await original_log(trajectories, split=split, **kwargs)

    object.__setattr__(model, "log", log)
    watch = _Settled()
    trainer = _trainer(model, backend, max_steps=10)
    trainer.add_observer(watch)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    find_leaf(exc, _LogFails)
    watch.check_against(trainer.statistics())
    in_batch = _batch_fates(model, watch)
    assert backend.step == 3 and len(in_batch) == 2
    assert all(e.fate is Fate.DROPPED_AT_STOP for e in in_batch)
    object.__setattr__(model, "log", original_log)
    resumed = _trainer(model, backend, max_steps=3)
    assert run_with_deadline(how, _train(resumed), DEADLINE_S) is None
    trained = backend.trained_ids
    assert len(trained) == len(set(trained)), "a scenario was trained twice"
    state = StateStore(Path(model._get_output_dir())).read()
    assert state is not None and all(state.ledger.is_resolved(e.scenario_index) for e in in_batch)


# == 9: the first error wins over observers raising during wind-down ===========================


class _WindDownObserverError(Exception):
    pass


@pytest.mark.parametrize("how", LOOPS)
def test_an_observer_raising_during_wind_down_does_not_replace_the_first_error(
    model: art.TrainableModel, how: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The observer's error used to be what train() raised (from the training stage's
    clean-up), hiding the failing backend.train."""
    backend = _FailingBackend()
    object.__setattr__(model, "_backend", backend)
    trainer = _trainer(model, backend, max_steps=10)
    calls: list[Fate] = []

    def observe(event: RunEvent) -> None:
        if isinstance(event, ScenarioSettled) and event.fate is Fate.DROPPED_AT_STOP:
            calls.append(event.fate)
            raise _WindDownObserverError("the exporter is gone too")

    trainer.add_observer(observe)
    caplog.set_level(logging.ERROR, logger="art_trio")
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    leaf, notes = find_leaf(exc, _FailingBackend.Failed)
    with pytest.raises(LookupError):
        find_leaf(exc, _WindDownObserverError)
    assert calls, "the observer was never called during wind-down"
    assert any("_WindDownObserverError" in note for note in leaf.__notes__), leaf.__notes__
    assert any("observer" in r.getMessage() and r.exc_info for r in caplog.records)
    # Every scenario still got its fate (the observer raised on each DROPPED one).
    assert _fates_add_up(trainer.statistics())


@pytest.mark.parametrize("how", LOOPS)
def test_an_observer_that_fails_first_is_still_the_error(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """The other way round: the observer's own error, when it comes first, ends the run, and
    observers raising again while it ends do not replace it."""
    trainer = _trainer(model, backend, max_steps=10)
    raised: list[int] = []

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 2 or raised and isinstance(
            event, ScenarioSettled
        ):
            raised.append(1)
            raise _WindDownObserverError(f"observer error {len(raised)}")

    trainer.add_observer(observe)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    leaf, _ = find_leaf(exc, _WindDownObserverError)
    assert str(leaf) == "observer error 1"
    assert _fates_add_up(trainer.statistics())


# == 11: statistics(), resize() and request_stop() from another thread =========================


class _Poller:
    """Another thread reading `statistics()` as fast as it can while the run goes."""

    def __init__(self, trainer: PipelineTrainer[Any, None]) -> None:
        self.trainer = trainer
        self.snapshots: list[RunStatistics] = []
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.is_set():
            try:
                self.snapshots.append(self.trainer.statistics())
            except BaseException as exc:  # noqa: BLE001  (the test reports it)
                self.errors.append(exc)
                return


@pytest.mark.parametrize("how", LOOPS)
def test_statistics_from_another_thread_is_a_consistent_snapshot(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """Under trio it raised ("must be called from async context"); under asyncio it read the
    counters while the loop changed them."""
    backend.train_seconds = 0.005
    trainer = _trainer(model, backend, max_steps=40, num_rollout_workers=8)
    poller = _Poller(trainer)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(_train(trainer))
            poller.thread.start()

    try:
        assert run_with_deadline(how, main, DEADLINE_S) is None
    finally:
        poller.done.set()
        poller.thread.join(30)
    assert poller.errors == []
    live = [s for s in poller.snapshots if s.running]
    assert len(live) >= 3, len(poller.snapshots)
    for before, after in zip(live, live[1:], strict=False):
        for name in ("taken", "trained", "stale", "errored", "dropped_at_stop", "steps"):
            assert getattr(after, name) >= getattr(before, name), (name, before, after)
    for s in live:
        settled = s.trained + s.stale + s.zero_variance + s.errored + s.dropped_at_stop
        # One instant: what is taken and not settled is in flight, queued or being trained
        # (each in one place: in flight and queued never count more than that).
        in_flight_or_queued = s.rollouts_in_flight + s.groups_queued
        assert 0 <= in_flight_or_queued <= s.taken - settled <= in_flight_or_queued + 2, s
        assert s.steps - s.policy_version in (0, 1), s
    assert trainer.statistics() == poller.trainer.statistics()
    assert not trainer.statistics().running


@pytest.mark.parametrize("how", LOOPS)
def test_a_blocked_loop_is_reported_to_another_thread_not_hung_on(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """A watchdog must learn that the loop is stuck (an observer blocking it here)."""
    release = threading.Event()
    answers: list[object] = []
    trainer = _trainer(model, backend, max_steps=4)

    def watchdog() -> None:
        try:
            trainer.statistics(timeout=0.2)
        except LoopUnresponsive as exc:
            answers.append(exc)
        finally:
            release.set()

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 2:
            threading.Thread(target=watchdog, daemon=True).start()
            release.wait(30)  # blocks the loop, as a badly written callback would

    trainer.add_observer(observe)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    assert len(answers) == 1 and "did not answer within 0.2 s" in str(answers[0])
    assert backend.step == 4


@pytest.mark.parametrize("how", LOOPS)
def test_resize_and_request_stop_from_another_thread(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    trainer = _trainer(model, backend, n=100_000)
    results: list[object] = []

    def controller() -> None:
        try:
            results.append(trainer.resize(num_rollout_workers=7))
            try:
                trainer.resize(num_rollout_workers=math.inf)
            except ValueError as exc:
                results.append(exc)
            trainer.request_stop()
        except BaseException as exc:  # noqa: BLE001
            results.append(exc)

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 3:
            threading.Thread(target=controller, daemon=True).start()

    trainer.add_observer(observe)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    assert len(results) == 2, results
    resized, refused = results
    assert isinstance(resized, RunStatistics) and resized.num_rollout_workers == 7
    assert isinstance(refused, ValueError)
    assert _fates_add_up(trainer.statistics())


# == more: observers that stop, resize or raise a BaseException ================================


@pytest.mark.parametrize("how", LOOPS)
@pytest.mark.parametrize("force", [False, True])
def test_an_observer_may_stop_the_run_from_inside_its_callback(
    model: art.TrainableModel, backend: RecordingBackend, how: str, force: bool
) -> None:
    watch = _Settled()
    trainer = _trainer(model, backend, n=100_000)

    def observe(event: RunEvent) -> None:
        watch(event)
        if isinstance(event, ScenarioSettled) and len(watch.settled) == 9:
            trainer.request_stop(force=force)
            trainer.request_stop(force=force)  # twice: harmless

    trainer.add_observer(observe)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    watch.check_against(trainer.statistics())
    trained = backend.trained_ids
    assert len(trained) == len(set(trained))


@pytest.mark.parametrize("how", LOOPS)
def test_an_observer_may_resize_the_run_from_inside_every_callback(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """Resizes from inside the rollout stage's and the trainer's own code paths: on every
    event, while the run goes and while it winds down."""
    watch = _Settled()
    trainer = _trainer(model, backend, max_steps=12)
    sizes = [1, 6, 2, 9, 3]

    def observe(event: RunEvent) -> None:
        watch(event)
        if isinstance(event, Resized):
            return  # resizing on its own Resized event would never end (see below)
        workers = sizes[len(watch.events) % len(sizes)]
        batch = 1 + len(watch.events) % 3
        trainer.resize(num_rollout_workers=workers, min_batch_size=batch, max_batch_size=batch)

    trainer.add_observer(observe)
    assert run_with_deadline(how, _train(trainer), DEADLINE_S) is None
    assert backend.step == 12
    watch.check_against(trainer.statistics())
    assert all(1 <= len(call.scenario_ids) <= 3 for call in backend.calls)


@pytest.mark.parametrize("how", LOOPS)
def test_an_observer_resizing_on_every_resized_event_fails_the_run_not_hangs_it(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """A feedback loop of the observer's own making: each resize emits `Resized`, which it
    answers with another resize. Python's recursion limit ends it as the observer's error,
    with every fate accounted for."""
    trainer = _trainer(model, backend, max_steps=12)
    flip = [1]

    def observe(event: RunEvent) -> None:
        if isinstance(event, (Resized, StepTrained)):
            flip[0] = 3 - flip[0]
            trainer.resize(num_rollout_workers=flip[0])

    trainer.add_observer(observe)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    find_leaf(exc, RecursionError)
    assert _fates_add_up(trainer.statistics())


class _NotAnException(BaseException):
    """What careless code sometimes derives from."""


@pytest.mark.parametrize("how", LOOPS)
@pytest.mark.parametrize("kind", [_NotAnException, KeyboardInterrupt, SystemExit])
def test_an_observer_raising_a_base_exception_ends_the_run_cleanly(
    model: art.TrainableModel, backend: RecordingBackend, how: str,
    kind: type[BaseException],
) -> None:
    trainer = _trainer(model, backend, max_steps=20)

    def observe(event: RunEvent) -> None:
        if isinstance(event, StepTrained) and event.step == 2:
            raise kind()

    trainer.add_observer(observe)
    exc = run_with_deadline(how, _train(trainer), DEADLINE_S)
    assert exc is not None
    leaf, _ = find_leaf(exc, kind)
    assert type(leaf) is kind
    assert backend.step < 20
    state = StateStore(Path(model._get_output_dir())).read()
    assert state is not None and state.training_step in (backend.step, backend.step - 1)
    # The lock is released: another trainer runs on the directory.
    again = _trainer(model, backend, max_steps=1)
    assert run_with_deadline(how, _train(again), DEADLINE_S) is None
