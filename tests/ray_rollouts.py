"""Rollout functions the Ray tests run on the cluster's workers (imported there by name).

Plain asyncio code, as an ART user writes it: nothing here knows about Ray or art_trio.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import art


def _where() -> dict[str, Any]:
    import ray  # only to report which node this ran on

    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


async def where_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    """A group of two trajectories recording where it ran and what the model looked like."""
    await asyncio.sleep(scenario.get("sleep", 0.0))
    info = {
        **_where(),
        "inference_name": model.get_inference_name(),
        "model_class": type(model).__name__,
        "config": config,
    }
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[{"role": "user", "content": str(scenario["id"])}],
            reward=float(i),
            metadata={key: str(value) for key, value in info.items()},
        )
        for i in range(2)
    )


def small_group() -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[], reward=float(i)) for i in range(2)]
    )


async def noop_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    return small_group()


async def sleep_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    await asyncio.sleep(scenario["sleep"])
    return small_group()


async def chat_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    """Asks the model's inference endpoint, through `model.openai_client()`, as rollouts do."""
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=[{"role": "user", "content": scenario["prompt"]}],
        max_tokens=4,
    )
    choice = completion.choices[0]
    return art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": scenario["prompt"]}, choice],
                reward=1.0,
                metadata={"pid": str(os.getpid())},
            )
        ]
    )


async def hour_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    """Writes `<dir>/started` (its pid), sleeps an hour; its `finally` writes `<dir>/finally`."""
    marks = Path(scenario["marks"])
    (marks / "started").write_text(str(os.getpid()))
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        (marks / "cancelled").write_text(str(os.getpid()))
        raise
    finally:
        (marks / "finally").write_text(str(os.getpid()))
    raise AssertionError("slept an hour")


async def failing_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    await asyncio.sleep(0)
    return _fail_deep(scenario)


def _fail_deep(scenario: Any) -> art.TrajectoryGroup:
    raise ValueError(f"no answer for prompt {scenario['prompt']!r} (pid {os.getpid()})")


async def marked_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    """Writes `<marks>/<scenario_id>.pid` (this worker's pid), then sleeps `sleep` seconds."""
    marks = Path(scenario["marks"])
    (marks / f"{scenario['metadata']['scenario_id']}.pid").write_text(str(os.getpid()))
    await asyncio.sleep(scenario["sleep"])
    return small_group()


async def varied_rollout(model: Any, scenario: Any, config: Any) -> art.TrajectoryGroup:
    """A few tens of milliseconds, then three different rewards (never zero variance)."""
    await asyncio.sleep(0.02 + 0.01 * (scenario["i"] % 5))
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[], reward=r) for r in (0.0, 0.5, 1.0)]
    )
