"""How long each way a run stops takes while asyncio code blocks in a thread forever.

For each loop (trio.run, anyio.run on asyncio) and each stop path, a run whose blocking call
never returns (it waits on a threading.Event set only after the measurement):

- ``grace``: rollouts in ``await asyncio.to_thread(...)``, ``request_stop()`` with
  ``shutdown_grace_seconds=GRACE``;
- ``second-signal``: the same rollouts, grace None, ``request_stop()`` then
  ``request_stop(force=True)`` (what a second SIGINT/SIGTERM does);
- ``failure``: ``backend.train`` in ``loop.run_in_executor(None, ...)``, the scenario source
  raising.

Prints, per case and repeat, the seconds from the stop (or the failure) to ``train()``
returning and to ``trio.run`` / ``anyio.run`` returning. A case still running after
``--deadline`` seconds is reported as such (the thread is then released). Usage:

    LITELLM_LOCAL_MODEL_COST_MAP=True python benchmarks/stop_bounds.py [--grace 0.5]
        [--repeats 5] [--deadline 30]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import anyio  # noqa: E402
import anyio.to_thread  # noqa: E402
import art  # noqa: E402
import trio  # noqa: E402

from art_trio import PipelineTrainer  # noqa: E402
from art_trio.testing import BackendDouble, trainable_model, trajectory  # noqa: E402


class Blocked:
    """A blocking call that returns once released; counts the threads inside it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.loop_event: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def block(self) -> None:
        if self.loop is not None and self.loop_event is not None:
            self.loop.call_soon_threadsafe(self.loop_event.set)
        self.entered.release()
        self.release.wait()


class Backend(BackendDouble):
    def __init__(self, blocked: Blocked | None) -> None:
        super().__init__(flavor="asyncio")
        self.blocked = blocked

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        if self.blocked is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.blocked.block)


def _scenarios(n: int) -> list[dict[str, Any]]:
    return [{"metadata": {"scenario_id": i}, "i": i} for i in range(n)]


async def _quick(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(0.0), trajectory(1.0)])


def case(how: str, path: str, grace: float, deadline: float) -> tuple[float, float] | None:
    """(train() returned, run returned), in seconds after the stop; None past the deadline."""
    blocked = Blocked()
    backend = Backend(blocked if path == "failure" else None)
    model = trainable_model(
        name="m", project="p", base_model="b", base_path=tempfile.mkdtemp(prefix="stop-")
    )
    asyncio.run(model.register(backend))
    marks: dict[str, float] = {}

    async def blocked_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
        await asyncio.to_thread(blocked.block)
        return await _quick(model, scenario, config)

    async def source() -> AsyncIterator[dict[str, Any]]:
        for scenario in _scenarios(2):
            yield scenario
        blocked.loop = asyncio.get_running_loop()
        blocked.loop_event = asyncio.Event()
        await blocked.loop_event.wait()
        marks["stop"] = time.monotonic()
        raise RuntimeError("the scenario source broke")

    trainer = PipelineTrainer(
        model, backend, _quick if path == "failure" else blocked_rollout,
        source() if path == "failure" else _scenarios(10), None,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, eval_step_0=False,
        shutdown_grace_seconds=grace if path == "grace" else None,
    )

    async def main() -> None:
        try:
            if path == "failure":
                await trainer.train(handle_signals=False)
                return
            async with anyio.create_task_group() as tg:
                await tg.start(functools.partial(trainer.train, handle_signals=False))
                for _ in range(2):
                    await anyio.to_thread.run_sync(blocked.entered.acquire)
                marks["stop"] = time.monotonic()
                trainer.request_stop()
                if path == "second-signal":
                    marks["stop"] = time.monotonic()
                    trainer.request_stop(force=True)
        finally:
            marks["train"] = time.monotonic()

    def run() -> None:
        try:
            if how == "trio":
                trio.run(main)
            else:
                anyio.run(main, backend="asyncio")
        except BaseException:  # noqa: BLE001  (the failure path ends in the source's error)
            pass
        marks["run"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the abandoned-call warning, expected here
        thread.start()
        thread.join(deadline)
    blocked.release.set()
    if "run" not in marks:
        thread.join()
        return None
    return marks["train"] - marks["stop"], marks["run"] - marks["stop"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=30.0)
    args = parser.parse_args(argv)
    print(f"grace {args.grace:g} s, {args.repeats} repeats; seconds after the stop (median, max)")
    print("| loop | path | train() returns | run returns |")
    print("|---|---|---|---|")
    for how in ("trio", "asyncio"):
        for path in ("grace", "second-signal", "failure"):
            results = [case(how, path, args.grace, args.deadline) for _ in range(args.repeats)]
            if any(r is None for r in results):
                print(f"| {how} | {path} | still running after {args.deadline:g} s | |")
                continue
            cells = []
            for column in (0, 1):
                values = [r[column] for r in results if r is not None]
                cells.append(f"{statistics.median(values):.3f} ({max(values):.3f})")
            print(f"| {how} | {path} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
