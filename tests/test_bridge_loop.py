"""The trio-asyncio loop `open_bridge()` opens itself: its ready queue and batched main loop.

`bridge/loop.py` gives the loop it opens a plain ready deque run in batches (issue 16). These pin
what asyncio code relies on and what the trainer relies on across that change: callbacks
run in order, timers fire and trio tasks run while asyncio code keeps the queue busy,
thread-safe callbacks and trio tasks started from asyncio arrive, a trio cancel cancels the
asyncio task (its `finally` runs) and the caller sees trio's Cancelled exactly once, and many
concurrent calls each get their own result. And what importing trio_asyncio changes in
asyncio is contained: after a trio run, asyncio code outside trio gets asyncio's own loops.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from art_trio.messages.errors import AsyncioTaskCancelled
from art_trio.plumbing.bridge.calls import Bridge, open_bridge

# Every test ends well inside this; a hang (a lost wake-up) fails instead of blocking CI.
DEADLINE_S = 20
REPO = Path(__file__).resolve().parent.parent


async def test_the_bridge_opens_its_own_loop_with_the_batched_queue() -> None:
    async with open_bridge() as bridge:
        assert bridge.uses_trio_asyncio

        async def loop_of_the_call() -> Any:
            return asyncio.get_running_loop()

        loop = await bridge.call(loop_of_the_call)
        # The rework is installed on the instance (a host's own loop is left stock).
        assert "call_soon" in vars(loop)


async def test_callbacks_run_in_the_order_they_were_scheduled() -> None:
    async with open_bridge() as bridge:

        async def schedule_many() -> list[int]:
            loop = asyncio.get_running_loop()
            seen: list[int] = []
            done = loop.create_future()
            for i in range(500):
                loop.call_soon(seen.append, i)
            loop.call_soon(done.set_result, None)
            await done
            return seen

        with trio.fail_after(DEADLINE_S):
            assert await bridge.call(schedule_many) == list(range(500))


async def test_a_coroutine_function_is_still_refused_by_call_soon() -> None:
    async with open_bridge() as bridge:

        async def misuse() -> None:
            async def coro_fn() -> None:
                pass

            asyncio.get_running_loop().call_soon(coro_fn)

        with pytest.raises(TypeError):
            await bridge.call(misuse)


async def test_timers_and_trio_tasks_run_while_asyncio_code_keeps_the_queue_busy() -> None:
    async with open_bridge() as bridge:
        stop = trio.Event()
        trio_ticks = 0

        async def spin() -> int:
            # Never lets the ready queue run empty: every iteration schedules the next step.
            spins = 0
            while not stop.is_set():
                await asyncio.sleep(0)
                spins += 1
            return spins

        async def timer_fires() -> str:
            await asyncio.sleep(0.01)  # a TimerHandle: the stock path must still serve it
            return "fired"

        async def trio_side() -> None:
            nonlocal trio_ticks
            while not stop.is_set():
                await trio.lowlevel.checkpoint()
                trio_ticks += 1

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                spins: list[int] = []

                async def run_spin() -> None:
                    spins.append(await bridge.call(spin))

                nursery.start_soon(run_spin)
                nursery.start_soon(trio_side)
                assert await bridge.call(timer_fires) == "fired"
                while trio_ticks < 100:
                    await trio.lowlevel.checkpoint()
                stop.set()
        assert spins and spins[0] > 0


async def test_call_soon_threadsafe_from_another_thread_wakes_the_loop() -> None:
    async with open_bridge() as bridge:

        async def from_a_thread() -> str:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[str] = loop.create_future()
            thread = threading.Thread(
                target=lambda: loop.call_soon_threadsafe(future.set_result, "from thread")
            )
            thread.start()
            try:
                return await future
            finally:
                thread.join()

        with trio.fail_after(DEADLINE_S):
            assert await bridge.call(from_a_thread) == "from thread"


async def test_a_trio_task_started_from_asyncio_code_runs() -> None:
    async with open_bridge() as bridge:

        async def trio_work(x: int) -> int:
            await trio.lowlevel.checkpoint()
            return x * 2

        async def asyncio_code() -> int:
            loop: Any = asyncio.get_running_loop()
            # An AsyncHandle: it travels on trio-asyncio's channel, not the ready deque.
            return int(await loop.trio_as_future(trio_work, 21))

        with trio.fail_after(DEADLINE_S):
            assert await bridge.call(asyncio_code) == 42


async def test_a_trio_cancel_cancels_the_asyncio_task_and_its_finally_runs() -> None:
    async with open_bridge() as bridge:
        started = trio.Event()
        events: list[str] = []

        async def long_rollout() -> None:
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                events.append("cancelled")
                raise
            finally:
                events.append("finally")

        with trio.fail_after(DEADLINE_S):
            with trio.CancelScope() as scope:

                async def cancel_when_started() -> None:
                    await started.wait()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_when_started)
                    await bridge.call(long_rollout)
                    events.append("returned")  # must not happen
        assert scope.cancelled_caught
        assert events == ["cancelled", "finally"]


async def test_a_cancel_the_asyncio_code_swallows_still_returns_its_result_once() -> None:
    async with open_bridge() as bridge:
        started = trio.Event()

        async def stubborn() -> str:
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                return "finished anyway"
            return "slept"

        results: list[str] = []
        with trio.fail_after(DEADLINE_S):
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_when_started() -> None:
                        await started.wait()
                        scope.cancel()

                    nursery.start_soon(cancel_when_started)
                    results.append(await bridge.call(stubborn))
                    await trio.lowlevel.checkpoint()  # the pending trio cancel lands here
                    results.append("not reached")
        assert results == ["finished anyway"]
        assert scope.cancelled_caught


async def test_asyncio_cancelling_itself_is_reported_not_taken_for_a_trio_cancel() -> None:
    async with open_bridge() as bridge:

        async def cancels_itself() -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)

        with trio.fail_after(DEADLINE_S), pytest.raises(AsyncioTaskCancelled):
            await bridge.call(cancels_itself)


async def test_many_concurrent_calls_each_get_their_own_result() -> None:
    async with open_bridge() as bridge:
        results: dict[int, list[int]] = {}

        async def echo(i: int, j: int) -> tuple[int, int]:
            await asyncio.sleep(0)
            if (i + j) % 7 == 0:
                await asyncio.sleep(0)
            return i, j

        async def caller(i: int) -> None:
            got = results.setdefault(i, [])
            for j in range(50):
                assert await bridge.callback(echo, i, j) == (i, j)
                got.append(j)

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(caller, i)
        assert results == {i: list(range(50)) for i in range(64)}


async def test_the_loop_closes_with_work_still_scheduled() -> None:
    ran: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with open_bridge() as bridge:

            async def leave_work_behind() -> None:
                loop = asyncio.get_running_loop()
                for i in range(10):
                    loop.call_soon(ran.append, f"late {i}")

            await bridge.call(leave_work_behind)
    # The loop's shutdown drain runs what was queued before it stopped.
    assert ran == [f"late {i}" for i in range(10)]


def test_the_asyncio_bridge_is_a_plain_await() -> None:
    async def main() -> str:
        async with open_bridge() as bridge:
            assert type(bridge) is Bridge

            async def plain() -> str:
                return "plain"

            return await bridge.call(plain)

    assert asyncio.run(main()) == "plain"


def test_asyncio_after_a_trio_run_gets_asyncios_own_loop() -> None:
    """In a fresh process (this one's conftest imports trio_asyncio itself): a trainer runs
    under trio.run, then asyncio.run, anyio.run on asyncio, asyncio.run in another thread and
    asyncio.run after set_event_loop_policy(None) each get asyncio's own loop, whose
    run_in_executor takes the program's own pool. They used to get trio-asyncio's
    SyncTrioEventLoop (importing trio_asyncio makes its policy's new_event_loop build one
    outside trio), which refused the pool with a bare AssertionError."""
    script = textwrap.dedent(
        """
        import asyncio, concurrent.futures, functools, sys, tempfile, threading
        import anyio, trio
        from art_trio import PipelineTrainer, trainable_model
        from tests.doubles import RecordingBackend, asyncio_rollout, scenarios

        assert "trio_asyncio" not in sys.modules
        backend = RecordingBackend()
        model = trainable_model(
            name="m", project="p", base_model="b", base_path=tempfile.mkdtemp()
        )
        asyncio.run(model.register(backend))
        trainer = PipelineTrainer(
            model, backend, asyncio_rollout, scenarios(10), None, num_rollout_workers=2,
            min_batch_size=2, max_batch_size=2, eval_step_0=False, max_steps=2,
        )
        trio.run(functools.partial(trainer.train, handle_signals=False))
        assert backend.step == 2 and "trio_asyncio" in sys.modules

        pool = concurrent.futures.ThreadPoolExecutor(1)
        seen = []

        async def check():
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(pool, sum, [1, 2]) == 3
            seen.append(type(loop))

        asyncio.run(check())
        anyio.run(check, backend="asyncio")
        thread = threading.Thread(target=asyncio.run, args=(check(),))
        thread.start()
        thread.join()
        asyncio.set_event_loop_policy(None)
        asyncio.run(check())
        pool.shutdown()
        assert len(seen) == 4, seen
        for loop_type in seen:
            assert issubclass(loop_type, asyncio.SelectorEventLoop), loop_type
            assert not loop_type.__module__.startswith("trio_asyncio"), loop_type
        print("asyncio's own loops:", sorted({t.__name__ for t in seen}))
        """
    )
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asyncio's own loops: ['_UnixSelectorEventLoop']" in done.stdout, done.stdout
