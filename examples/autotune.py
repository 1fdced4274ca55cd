"""Online autotuning: the trainer finds the fewest rollout workers that keep it fed.

Starts far too wide (64 workers for batches of 8) and lets
``autotune=PipelineAutotuneConfig(mode="online")`` bring the worker count down while it
trains; every decision is logged, written to ``history.jsonl`` and saved as a profile that
``mode="profile"`` starts from next time.

To run in a second it uses trio's ``MockClock`` (virtual time: 50 ms rollouts and 100 ms
steps cost nothing real) and the backend double of ``art_trio.testing``; with a real backend
and real rollouts the same three lines of configuration apply.

    python examples/autotune.py              # writes under ./.art
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402
import trio  # noqa: E402
import trio.testing  # noqa: E402

from art_trio import (  # noqa: E402
    PipelineAutotuneConfig,
    PipelineTrainer,
    trainable_model,  # noqa: E402
    trio_native,
)
from art_trio.demo import start_over  # noqa: E402
from art_trio.testing import BackendDouble, trajectory_group  # noqa: E402

STEPS = 80
draws = random.Random(0)


@trio_native  # written for trio: runs in the trainer's task, and sleeps in virtual time
async def rollout(model: art.TrainableModel, scenario: dict[str, Any], config: None) -> Any:
    await trio.sleep(draws.expovariate(1 / 0.05))  # a 50 ms mean rollout
    return trajectory_group([0.0, 1.0, draws.random()])


def scenarios() -> Iterator[dict[str, Any]]:
    for i in range(1_000_000):
        yield {"question": i, "metadata": {"scenario_id": f"q{i}"}}


async def main() -> None:
    model: art.TrainableModel = trainable_model(
        name="autotune", project="examples", base_model="any"
    )
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    backend = BackendDouble(train_time=0.1)  # every step takes 100 ms
    await model.register(backend)
    # --8<-- [start:trainer]
    trainer = PipelineTrainer(
        model, backend, rollout, scenarios(), None,
        autotune=PipelineAutotuneConfig(
            mode="online",
            initial_model_calls_per_inference_gpu=64,  # the worker count to start from
            initial_min_groups_per_packed_sequence=8,  # batch sizes to start from
            initial_max_groups_per_packed_sequence=8,
        ),
        max_steps_off_policy=1, max_steps=STEPS, resume=False,
    )  # fmt: skip
    # --8<-- [end:trainer]
    await trainer.train(handle_signals=False)

    stats = trainer.statistics()
    profile_file = Path(model._get_output_dir()) / "pipeline_tuner" / "latest.json"
    profile = json.loads(profile_file.read_text())
    print(f"workers: 64 -> {stats.num_rollout_workers} after {stats.steps} steps, trainer "
          f"utilization {stats.trainer_utilization:.2f}; profile: {profile_file}")  # fmt: skip
    for d in profile["decisions"]:
        print(f"  step {d['step']}: {d['action']} -> {d['num_rollout_workers']} ({d['reason']})")
    assert stats.num_rollout_workers < 64


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
