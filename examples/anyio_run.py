"""The trainer under ``anyio.run``: on asyncio (anyio's default) or on trio, one program.

Under asyncio no trio-asyncio is involved at all: the trainer's stages are anyio tasks on the
asyncio loop and your asyncio rollout code runs on that loop directly. The trainer is started
in an anyio task group with ``await tg.start(trainer.train)``, exactly as in a nursery.

    python examples/anyio_run.py             # asyncio
    python examples/anyio_run.py trio        # the same program on trio
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import anyio  # noqa: E402
import art  # noqa: E402
import sniffio  # noqa: E402

from art_trio import PipelineRuntimeConfig, PipelineTrainer, trainable_model  # noqa: E402
from art_trio.demo import (  # noqa: E402
    CpuBackend,
    TaskConfig,
    eval_fn,
    rollout,
    scenarios,
    start_over,
)

STEPS = 3


async def main() -> None:
    loop = sniffio.current_async_library()
    model: art.TrainableModel = trainable_model(
        name=f"anyio-{loop}", project="examples", base_model="cpu-demo"
    )
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            rollout,
            scenarios(0),
            TaskConfig(),
            eval_fn,
            pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=2),
            max_steps_off_policy=1,
            max_steps=STEPS,
        )
        # --8<-- [start:anyio]
        async with anyio.create_task_group() as tg:
            await tg.start(trainer.train)  # every stage runs from here on
            print(f"training on {loop}: running={trainer.statistics().running}")
        # --8<-- [end:anyio]
    if trainer.stop_signal:  # Ctrl-C (or SIGTERM) stopped it cleanly, state saved:
        raise SystemExit(128 + trainer.stop_signal)  # exit as an interrupted program (130)
    print(f"{loop}: trained {trainer.statistics().steps} steps")
    assert trainer.statistics().steps == STEPS


if __name__ == "__main__":
    # --8<-- [start:run]
    loop = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
    anyio.run(main, backend=loop)  # "asyncio": no trio-asyncio involved; or "trio"
    # --8<-- [end:run]
