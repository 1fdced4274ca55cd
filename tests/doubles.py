"""Test doubles for what cannot run here (GPUs), on `art_trio.testing`'s ART Backend double.

`RecordingBackend` is deliberately asyncio-only (the shared double's asyncio flavor): every
method asserts it runs inside an asyncio event loop and uses asyncio primitives, so a test
passes only if art_trio really reaches it through asyncio (trio-asyncio under trio).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import art
import trio
from openai.types.chat.chat_completion import Choice

from art_trio.plumbing.compat import TRAIN_METRIC_NAMES
from art_trio.testing.doubles import BackendDouble, TrainBatch, group_initial_version
from art_trio.testing.doubles import trajectory as shared_trajectory

#: Where the quantities both lines log land in `history.jsonl` on the installed line (after
#: `model.log` prefixed them), for the tests that read a run's history.
HISTORY_KEYS: dict[str, str] = (
    {
        "stale_groups": "discarded/cum/stale_groups",
        "step_wall_s": "time/step_wall_s",
        "trainer_idle_s": "time/step_trainer_idle_s",
        "backend_train_s": "time/step_backend_train_s",
        "rollout_s": "time/step_rollout_s",
        "rollout_idle_s": "time/step_rollout_idle_s",
    }
    if TRAIN_METRIC_NAMES == "0.5.23"
    else {
        "stale_groups": "train/discarded_stale_groups",
        "step_wall_s": "time/step_wall_s",
        "trainer_idle_s": "throughput/step_trainer_idle_s",
        "backend_train_s": "time/step_trainer_s",
        "rollout_s": "time/step_actor_s",
        "rollout_idle_s": "throughput/step_actor_idle_s",
    }
)


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
class RecordingBackend(BackendDouble):
    """The shared ART Backend double, asyncio flavor: records every train call, optional
    train delay, can hold train() until released, writes and deletes checkpoint files."""

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

    def __post_init__(self) -> None:
        BackendDouble.__init__(
            self,
            flavor="asyncio",
            initial_step=self.step,
            fail_on_step=self.fail_on_step,
            # Do the "work" in an asyncio task, as real backends do.
            work_in_task=True,
        )

    @property
    def trained_ids(self) -> list[int]:
        """The scenario indices of every train call, in order."""
        return [i for call in self.calls for i in call.scenario_ids]

    def train_seconds_for(self, index: int) -> float:
        return self.train_seconds

    async def before_train(self, groups: list[art.TrajectoryGroup]) -> None:
        if self.hold_train:
            if self._release is None:
                self._release = asyncio.Event()
            await self._release.wait()

    def record(self, batch: TrainBatch) -> None:
        groups = batch.groups
        self.calls.append(
            TrainCall(
                step=batch.step,
                kwargs=batch.kwargs,
                scenario_ids=[g.metadata.get("scenario_id") for g in groups],
                initial_versions=[group_initial_version(g) for g in groups],
                rewards=[[t.reward for t in g.trajectories] for g in groups],
            )
        )
        if self.write_checkpoints and batch.kwargs.get("save_checkpoint"):
            path = Path(batch.model._get_output_dir()) / "checkpoints" / f"{batch.step:04d}"
            path.mkdir(parents=True, exist_ok=True)
            (path / "weights.txt").write_text(str(batch.step))

    def train_metrics(self, batch: TrainBatch) -> dict[str, float]:
        loss = sum(sum(r) for r in self.calls[-1].rewards) / max(1, len(batch.groups))
        return {"loss": loss if math.isfinite(loss) else 0.0}

    def delete_checkpoints(self, model: Any, steps_to_keep: list[int]) -> None:
        self.deleted_keep_lists.append(list(steps_to_keep))
        directory = Path(model._get_output_dir()) / "checkpoints"
        if directory.is_dir():
            for path in directory.iterdir():
                if path.name.isdigit() and int(path.name) not in steps_to_keep:
                    for f in path.iterdir():
                        f.unlink()
                    path.rmdir()

    def release(self) -> None:
        """Let held train() calls proceed (call from asyncio or trio-asyncio context)."""
        self.hold_train = False
        if self._release is not None:
            self._release.set()


def trajectory(reward: float, **kwargs: Any) -> art.Trajectory:
    """A one-exchange trajectory with the serving usage ART 0.5.20+'s trainer requires."""
    return shared_trajectory(reward, **kwargs)


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
