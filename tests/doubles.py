"""Test doubles for what cannot run here (GPUs), implementing ART's real Backend protocol.

`RecordingBackend` is deliberately asyncio-only: every method asserts it runs inside an
asyncio event loop and uses asyncio primitives, so a test passes only if art_trio really
reaches it through asyncio (trio-asyncio under trio).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import art
import trio
from art.types import TrainResult
from openai.types.chat.chat_completion import Choice


def _require_asyncio() -> asyncio.AbstractEventLoop:
    # Raises RuntimeError outside an asyncio loop (e.g. called straight from trio).
    return asyncio.get_running_loop()


@dataclass
class TrainCall:
    step: int
    kwargs: dict[str, Any]
    scenario_ids: list[Any]
    initial_versions: list[int | None]
    rewards: list[list[float]]


@dataclass
class RecordingBackend:
    """ART Backend double: counts steps, records every train call, optional train delay."""

    train_seconds: float = 0.0
    fail_on_step: int | None = None
    step: int = 0
    calls: list[TrainCall] = field(default_factory=list)
    deleted_keep_lists: list[list[int]] = field(default_factory=list)
    write_checkpoints: bool = True
    #: Set by a test to hold train() until it is released (an asyncio.Event made lazily).
    hold_train: bool = False
    _release: asyncio.Event | None = None
    train_started: int = 0

    # -- ART's Backend protocol ----------------------------------------------------------

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        return f"{model.name}@{self.step if step is None else step}"

    async def close(self) -> None:
        _require_asyncio()

    async def register(self, model: Any) -> None:
        _require_asyncio()

    async def _get_step(self, model: Any) -> int:
        _require_asyncio()
        return self.step

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        _require_asyncio()
        self.deleted_keep_lists.append(list(steps_to_keep))
        directory = Path(model._get_output_dir()) / "checkpoints"
        if directory.is_dir():
            for path in directory.iterdir():
                if path.name.isdigit() and int(path.name) not in steps_to_keep:
                    for f in path.iterdir():
                        f.unlink()
                    path.rmdir()

    async def _prepare_backend_for_training(self, model: Any, config: Any) -> tuple[str, str]:
        _require_asyncio()
        return "http://127.0.0.1:9/v1", "test-key"

    async def train(
        self, model: Any, trajectory_groups: Iterable[art.TrajectoryGroup], **kwargs: Any
    ) -> TrainResult:
        loop = _require_asyncio()
        groups = list(trajectory_groups)
        self.train_started += 1
        if self.hold_train:
            if self._release is None:
                self._release = asyncio.Event()
            await self._release.wait()
        # Do the "work" in an asyncio task, as real backends do.
        done = asyncio.Event()

        async def work() -> None:
            await asyncio.sleep(self.train_seconds)
            done.set()

        task = loop.create_task(work())
        await done.wait()
        await task
        if self.fail_on_step is not None and self.step + 1 == self.fail_on_step:
            raise RuntimeError(f"backend exploded at step {self.step + 1}")
        self.step += 1
        self.calls.append(
            TrainCall(
                step=self.step,
                kwargs=dict(kwargs),
                scenario_ids=[g.metadata.get("scenario_id") for g in groups],
                initial_versions=[
                    min(
                        (t.initial_policy_version for t in g.trajectories
                         if t.initial_policy_version is not None),
                        default=None,
                    )
                    for g in groups
                ],
                rewards=[[t.reward for t in g.trajectories] for g in groups],
            )
        )
        if self.write_checkpoints and kwargs.get("save_checkpoint"):
            path = Path(model._get_output_dir()) / "checkpoints" / f"{self.step:04d}"
            path.mkdir(parents=True, exist_ok=True)
            (path / "weights.txt").write_text(str(self.step))
        loss = sum(sum(r) for r in self.calls[-1].rewards) / max(1, len(groups))
        return TrainResult(step=self.step, metrics={"loss": loss if math.isfinite(loss) else 0.0})

    def release(self) -> None:
        """Let held train() calls proceed (call from asyncio or trio-asyncio context)."""
        self.hold_train = False
        if self._release is not None:
            self._release.set()


def trajectory(reward: float, **kwargs: Any) -> art.Trajectory:
    # The serving response's usage, which ART 0.5.20+'s trainer requires of every trajectory.
    kwargs["metrics"] = {"completion_tokens": 1, **kwargs.get("metrics", {})}
    return art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ],
        reward=reward,
        **kwargs,
    )


def served_trajectory(reward: float, step: int) -> art.Trajectory:
    """A trajectory whose completion a server attributed to exactly `step`'s weights.

    ART 0.5.20+ annotates each served choice with `policy_token_spans` (which policy version
    produced which tokens) and its trainer refuses an eval whose trajectories lack them.
    """
    choice = Choice.model_validate(
        {
            "finish_reason": "stop",
            "index": 0,
            "message": {"role": "assistant", "content": "a"},
            "policy_token_spans": [
                {
                    "start_token": 0,
                    "end_token": 1,
                    "generation_id": f"gen-{step}",
                    "policy_version": step,
                    "lora_slot": "default",
                    "update_seq": 0,
                }
            ],
        }
    )
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, choice],
        reward=reward,
        metrics={"completion_tokens": 1},
    )


def scenarios(n: int, **extra: Any) -> list[dict[str, Any]]:
    """`n` dict scenarios with scenario_id metadata 0..n-1."""
    return [{"metadata": {"scenario_id": i, **extra}, "i": i} for i in range(n)]


async def asyncio_rollout(model: Any, scenario: dict[str, Any], config: Any) -> art.TrajectoryGroup:
    """An ART-style rollout: asyncio code (asyncio.sleep, asyncio.gather)."""
    _require_asyncio()
    i = scenario["i"]

    async def one(k: int) -> art.Trajectory:
        await asyncio.sleep(0.001)
        return trajectory(float((i + k) % 3) / 2)

    return art.TrajectoryGroup(await asyncio.gather(*(one(k) for k in range(3))))


def announce_training(backend: RecordingBackend) -> trio.Event:
    """A trio Event set when `backend.train` is entered (its asyncio code still runs in a
    trio task under trio-asyncio, so setting a trio Event there is allowed)."""
    running = trio.Event()
    original_train = backend.train

    async def train(*args: Any, **kwargs: Any) -> Any:
        running.set()
        return await original_train(*args, **kwargs)

    backend.train = train  # type: ignore[method-assign]
    return running
