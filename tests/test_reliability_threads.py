"""Blocking calls in threads, which no stop can interrupt (issue 51, items 3 and 5).

What a user may rely on:

- a stop's grace period, a forced stop (the second signal) and a failure bound how long
  `train()` takes to return, under trio as under asyncio, even while a rollout awaits
  `asyncio.to_thread(...)` or `backend.train` awaits `loop.run_in_executor(None, ...)` on a
  call that never returns: the thread is left to finish on its own (a daemon thread), a
  RuntimeWarning names the call, the state is saved, and `anyio.run` returns too (asyncio's
  own default executor would be joined when the loop closes);
- a rollout may hand work to its own executor (`loop.run_in_executor(my_pool, ...)`) under
  `trio.run` as under asyncio (test_bridge_loop.py: asyncio's own loops after a trio run).

Each run happens in a thread with a deadline, so a run that waits for the thread fails the
test instead of hanging it. The blocking call waits on a threading.Event that the test sets
when it ends, so no thread outlives the test. Time is the real clock (trio's virtual clock
cannot reach asyncio): the grace period is small (0.2 s) and the bound generous (BOUND_S).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import art
import pytest

from art_trio import PipelineTrainer
from tests.doubles import RecordingBackend, asyncio_rollout, scenarios, trajectory
from tests.errors import find_leaf
from tests.loops import run_with_deadline, sidecar

HOW = ["trio", "asyncio"]
GRACE_S = 0.2
#: From the stop (or the failure) to train() and then trio.run / anyio.run returning: a bound
#: far above the grace period, so a loaded machine never fails it; without the fix the runs
#: never return at all.
BOUND_S = 15.0


class Never:
    """A blocking call that returns only when the test has ended (`release`)."""

    def __init__(self) -> None:
        self._released = threading.Event()
        self._lock = threading.Condition()
        self.entered = 0
        self.running = 0

    def block(self) -> None:
        with self._lock:
            self.entered += 1
            self.running += 1
            self._lock.notify_all()
        try:
            self._released.wait()
        finally:
            with self._lock:
                self.running -= 1
                self._lock.notify_all()

    def wait_entered(self, count: int) -> None:
        with self._lock:
            assert self._lock.wait_for(lambda: self.entered >= count, timeout=BOUND_S)

    def release(self) -> None:
        self._released.set()
        with self._lock:
            assert self._lock.wait_for(lambda: self.running == 0, timeout=BOUND_S)


@pytest.fixture
def never() -> Iterator[Never]:
    blocking = Never()
    try:
        yield blocking
    finally:
        blocking.release()


def _trainer(
    model: art.TrainableModel, backend: RecordingBackend, rollout_fn: Any, **kwargs: Any
) -> PipelineTrainer[Any, None]:
    options: dict[str, Any] = {
        "num_rollout_workers": 2,
        "min_batch_size": 2,
        "max_batch_size": 2,
        "eval_step_0": False,
        "shutdown_grace_seconds": GRACE_S,
    }
    options.update(kwargs)
    source = options.pop("source", None)
    return PipelineTrainer(
        model, backend, rollout_fn, scenarios(6) if source is None else source, None, **options
    )


def _resume_trains_every_scenario_once(
    how: str, model: art.TrainableModel, backend: RecordingBackend
) -> None:
    """The ledger after the stopped run: a resumed run trains all 6 scenarios, none twice."""
    resumed = _trainer(model, backend, asyncio_rollout)
    train = functools.partial(resumed.train, handle_signals=False)
    assert run_with_deadline(how, train, 60 + BOUND_S) is None
    trained = [i for call in backend.calls for i in call.scenario_ids]
    assert sorted(trained) == list(range(6)), trained


def _abandoned_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning)
        and "blocking call(s) running in threads" in str(w.message)
    ]


class _Times:
    stop: float = 0.0
    returned: float = 0.0


async def _stop_when_blocked(
    trainer: PipelineTrainer[Any, None], never: Never, times: _Times, *, force: bool
) -> None:
    """Start train(), and once both workers block in the thread, stop it (first gracefully,
    then with `force`, as a second signal does); `times` gets when the stop that must end
    the run came and when train() returned."""
    async with anyio.create_task_group() as tg:
        await tg.start(functools.partial(trainer.train, handle_signals=False))
        await anyio.to_thread.run_sync(never.wait_entered, 2)
        times.stop = time.monotonic()
        trainer.request_stop()
        if force:
            # The first stop waits for the rollouts (grace None); the forced one must not.
            times.stop = time.monotonic()
            trainer.request_stop(force=True)
    times.returned = time.monotonic()


@pytest.mark.parametrize("call", ["to_thread", "run_in_executor"])
@pytest.mark.parametrize("force", [False, True], ids=["grace", "forced"])
@pytest.mark.parametrize("how", HOW)
def test_a_stop_does_not_wait_for_a_rollout_blocked_in_a_thread(
    model: art.TrainableModel,
    backend: RecordingBackend,
    never: Never,
    how: str,
    force: bool,
    call: str,
) -> None:
    """Rollouts blocked in a call that never returns: after the grace period (or at once on
    a forced stop, with grace None) train() returns, and so does the run; the calls are
    named in a warning; nothing was trained or resolved, and a resume trains every scenario
    once. Under trio it used to wait for the thread (trio-asyncio's executor), under asyncio
    anyio.run did (the loop's default executor, joined at its close)."""

    async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
        loop = asyncio.get_running_loop()
        if call == "to_thread":
            await asyncio.to_thread(never.block)
        else:
            await loop.run_in_executor(None, never.block)
        return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])

    grace = None if force else GRACE_S
    trainer = _trainer(model, backend, rollout, shutdown_grace_seconds=grace)
    times = _Times()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = run_with_deadline(
            how, lambda: _stop_when_blocked(trainer, never, times, force=force), 60 + BOUND_S
        )
        run_returned = time.monotonic()
    assert outcome is None, repr(outcome)
    assert times.returned - times.stop < BOUND_S
    assert run_returned - times.stop < BOUND_S
    assert never.running == 2, "the calls were to be left running, not ended"
    [warning] = _abandoned_warnings(caught)
    assert "2 blocking call(s)" in warning and "Never.block (x2)" in warning, warning
    assert backend.calls == []
    state = sidecar(model)
    assert state["scenario_offset"] == 0 and state["resolved_scenarios"] == []
    assert state["pending_batch"] is None
    _resume_trains_every_scenario_once(how, model, backend)


class BlockingTrainBackend(RecordingBackend):
    """`backend.train` hands a call that never returns to the loop's default executor."""

    never: Never | None = None
    #: Set (in the loop) once the call is running in its thread.
    blocked: asyncio.Event | None = None

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        if self.never is None:
            return
        loop = asyncio.get_running_loop()
        never, blocked = self.never, self._blocked()

        def block() -> None:
            loop.call_soon_threadsafe(blocked.set)
            never.block()

        await loop.run_in_executor(None, block)

    def _blocked(self) -> asyncio.Event:
        if self.blocked is None:
            self.blocked = asyncio.Event()
        return self.blocked


@pytest.mark.parametrize("how", HOW)
def test_a_failure_does_not_wait_for_a_backend_train_blocked_in_a_thread(
    model: art.TrainableModel, never: Never, how: str
) -> None:
    """The scenario source breaks while `backend.train` is blocked in
    `run_in_executor(None, ...)`: train() raises the source's error at once, the call is
    named in a warning, the batch stays pending, and a resume trains every scenario once.
    The failed run used to end only when the thread returned."""
    backend = BlockingTrainBackend()
    asyncio.run(model.register(backend))
    backend.never = never

    times = _Times()

    async def source() -> AsyncIterator[dict[str, Any]]:
        for scenario in scenarios(2):
            yield scenario
        await backend._blocked().wait()
        times.stop = time.monotonic()
        raise RuntimeError("the scenario source broke")

    trainer = _trainer(model, backend, asyncio_rollout, source=source())

    async def main() -> None:
        try:
            await trainer.train(handle_signals=False)
        finally:
            times.returned = time.monotonic()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = run_with_deadline(how, main, 60 + BOUND_S)
        run_returned = time.monotonic()
    assert outcome is not None
    leaf, _ = find_leaf(outcome, RuntimeError)
    assert "the scenario source broke" in str(leaf)
    assert never.running == 1
    assert times.returned - times.stop < BOUND_S
    assert run_returned - times.stop < BOUND_S
    [warning] = _abandoned_warnings(caught)
    assert "1 blocking call(s)" in warning and "block" in warning, warning
    assert backend.calls == []
    assert sidecar(model)["pending_batch"] == {"step": 1, "scenario_indices": [0, 1]}
    backend.never = None
    _resume_trains_every_scenario_once(how, model, backend)


@pytest.mark.parametrize("how", HOW)
def test_a_forced_stop_does_not_wait_for_cpubackends_training_step(
    tmp_path: Path, never: Never, how: str
) -> None:
    """CPUBackend (on the tiny real model) runs its step in a thread; a forced stop while
    the step runs ends train() and the run at once, the batch pending (resume settles it
    against the backend's step). Under trio the step ran in trio-asyncio's executor, and the
    second Ctrl-C waited for it (20 s for a SmolLM2 step)."""
    from tests.tiny_llm import MISSING, tiny_model_dir

    if MISSING:
        pytest.skip(f"needs the llm extra (missing {', '.join(MISSING)})")
    from art_trio import trainable_model
    from art_trio.cpu import CPUBackend

    cpu = CPUBackend(tiny_model_dir(tmp_path / "tiny"))
    model = trainable_model(name="cpu", project="p", base_model="tiny", base_path=str(tmp_path))

    def train_sync(*args: Any, **kwargs: Any) -> Any:
        never.block()
        raise AssertionError("the step was to be left running")

    cpu._train_sync = train_sync  # type: ignore[method-assign]
    trainer = PipelineTrainer(
        model, cpu, asyncio_rollout, scenarios(6), None, num_rollout_workers=2,
        min_batch_size=2, max_batch_size=2, eval_step_0=False, shutdown_grace_seconds=None,
    )
    times = _Times()

    async def main() -> None:
        async with cpu:
            await model.register(cpu)
            async with anyio.create_task_group() as tg:
                await tg.start(functools.partial(trainer.train, handle_signals=False))
                await anyio.to_thread.run_sync(never.wait_entered, 1)
                trainer.request_stop()  # the step in progress would be waited for
                times.stop = time.monotonic()
                trainer.request_stop(force=True)  # what the second Ctrl-C does
            times.returned = time.monotonic()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = run_with_deadline(how, main, 60 + BOUND_S)
        run_returned = time.monotonic()
    assert outcome is None, repr(outcome)
    assert times.returned - times.stop < BOUND_S and run_returned - times.stop < BOUND_S
    assert never.running == 1
    if how == "trio":
        # Under asyncio the step runs in CPUBackend's own training thread, not the loop's
        # default executor: nothing waits for it there either, but nothing names it.
        [warning] = _abandoned_warnings(caught)
        assert "CPUBackend.train.<locals>.work" in warning, warning
    assert sidecar(model)["pending_batch"]["step"] == 1


# -- item 5: own executors -------------------------------------------------------------------


@pytest.mark.parametrize("how", HOW)
def test_a_rollout_may_run_blocking_work_in_its_own_executor(
    model: art.TrainableModel, backend: RecordingBackend, how: str
) -> None:
    """`loop.run_in_executor(my_pool, env_step)`, valid asyncio: under trio.run it failed
    with a bare AssertionError (trio-asyncio takes only its own executor)."""
    threads: set[str] = set()

    def env_step(i: int) -> float:
        threads.add(threading.current_thread().name)
        return float(i % 2)

    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="env") as pool:

        async def rollout(model: Any, scenario: dict[str, Any], config: Any) -> Any:
            loop = asyncio.get_running_loop()
            rewards = [
                await loop.run_in_executor(pool, env_step, scenario["i"] + k) for k in (0, 1)
            ]
            return art.TrajectoryGroup([trajectory(r) for r in rewards])

        trainer = _trainer(model, backend, rollout, max_steps=3)
        train = functools.partial(trainer.train, handle_signals=False)
        assert run_with_deadline(how, train, 60 + BOUND_S) is None
    assert trainer.last_counters is not None and trainer.last_counters.errored == 0
    assert backend.step == 3
    assert threads and all(name.startswith("env") for name in threads)


def test_the_executor_bounds_its_daemon_threads_and_names_abandoned_calls() -> None:
    """`DaemonExecutor` directly: with 2 workers, 2 calls run and the others wait their turn;
    every thread is a daemon; a running call whose future is cancelled (what cancelling
    `await asyncio.to_thread(...)` does) is named once as abandoned, a queued one never runs,
    and `shutdown(wait=True)` waits for neither."""
    from art_trio.plumbing.bridge.blocking import DaemonExecutor

    executor = DaemonExecutor(max_workers=2)
    gates = [threading.Event() for _ in range(6)]
    entered: list[int] = []
    daemons: list[bool] = []
    changed = threading.Condition()

    def step(i: int) -> int:
        with changed:
            entered.append(i)
            daemons.append(threading.current_thread().daemon)
            changed.notify_all()
        gates[i].wait()
        return i

    def when_entered(count: int) -> list[int]:
        with changed:
            assert changed.wait_for(lambda: len(entered) >= count, timeout=BOUND_S)
            return sorted(entered)

    try:
        futures = [executor.submit(step, i) for i in range(5)]
        assert when_entered(2) == [0, 1]
        assert [f.running() for f in futures] == [True, True, False, False, False]
        assert not futures[0].cancel()  # running: its caller gives up, the thread goes on
        assert all(f.cancel() for f in futures[3:])  # queued: they never run
        assert executor.abandoned() == [f"{__name__}.{step.__qualname__}"]
        assert executor.abandoned() == []  # named once
        gates[1].set()  # call 1 returns, call 2 takes its worker
        assert futures[1].result(timeout=BOUND_S) == 1
        assert when_entered(3) == [0, 1, 2]
        assert not futures[2].cancel()
        executor.shutdown(wait=True)  # its running calls abandoned, its queued ones cancelled
        assert futures[0].running() and futures[2].running()
        assert all(daemons)
        with pytest.raises(RuntimeError, match="after shutdown"):
            executor.submit(step, 5)
    finally:
        for gate in gates:
            gate.set()
    assert futures[2].result(timeout=BOUND_S) == 2  # let go of, it still ended on its own
    assert sorted(entered) == [0, 1, 2]
