"""One training run whose rollouts run on a Ray cluster, resuming from a directory.

    python -m tests.ray_crash_child <dir> <total_steps>

The test kills it with SIGKILL mid-run and starts it again. The backend double appends each
trained step (its scenario ids) to <dir>/trained.log and fsyncs before returning (see
tests/crash_harness.py), so what was trained survives the kill. Connects to the cluster that
`ray.init()` finds (RAY_ADDRESS). Prints `@ step <n>` after each durable step.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import functools
import random
import sys
from pathlib import Path

import trio

from art_trio import PipelineTrainer, RayRolloutExecutor
from art_trio.plumbing.compat import trainable_model
from tests import ray_rollouts
from tests.crash_harness import TRAINED_LOG, DurableBackend, emit, trio_asyncio_call
from tests.doubles import scenarios


async def main(directory: Path, total_steps: int) -> None:
    backend = DurableBackend(directory / TRAINED_LOG, random.Random(0))
    model = trainable_model(
        name="ray-crash", project="p", base_model="test-base", base_path=str(directory / ".art")
    )
    await trio_asyncio_call(model.register, backend)
    if backend.step >= total_steps:
        return
    # CPU-free actors: the test module's own executor may hold every CPU of the cluster.
    executor = RayRolloutExecutor(num_actors=2, actor_options={"num_cpus": 0})
    try:
        trainer = PipelineTrainer(
            model, backend, ray_rollouts.varied_rollout, scenarios(1_000), None,
            rollout_executor=executor, num_rollout_workers=4, min_batch_size=2,
            max_batch_size=2, max_steps_off_policy=total_steps,
            max_steps=total_steps - backend.step, eval_step_0=False,
        )
        await trainer.train(handle_signals=False)
    finally:
        executor.shutdown()
    emit(f"done {backend.step}")


if __name__ == "__main__":
    trio.run(functools.partial(main, Path(sys.argv[1]), int(sys.argv[2])))
