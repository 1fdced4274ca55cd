"""A deadline around training: a trio cancel scope stops the trainer, and a resume continues.

``train()`` is an ordinary trio task: cancelling the scope it runs in (``trio.move_on_after``,
``nursery.cancel_scope.cancel()``) ends the run at once, as ``request_stop(force=True)`` does:
rollouts and a running ``backend.train`` are cancelled, the resume state is saved, and nothing
the trainer started outlives the scope. For a graceful stop (in-flight rollouts get
``shutdown_grace_seconds`` to finish) call ``trainer.request_stop()`` instead.

    python examples/cancel_scope.py           # writes under ./.art
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402
import trio  # noqa: E402

from art_trio import (  # noqa: E402
    PipelineRuntimeConfig,
    PipelineTrainer,
    StepTrained,
    trainable_model,  # noqa: E402
)
from art_trio.demo import CpuBackend, TaskConfig, rollout, scenarios, start_over  # noqa: E402


async def main() -> None:
    model: art.TrainableModel = trainable_model(
        name="cancel-scope", project="examples", base_model="cpu-demo"
    )
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)

        def new_trainer() -> PipelineTrainer:
            return PipelineTrainer(
                model, backend, rollout, scenarios(0), TaskConfig(),
                pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=2),
                max_steps_off_policy=1, learning_rate=0.05,
            )  # fmt: skip

        # --8<-- [start:deadline]
        trainer = new_trainer()
        two_steps = trio.Event()
        trainer.add_observer(
            lambda e: isinstance(e, StepTrained) and e.step == 2 and two_steps.set()
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer.train)
            await two_steps.wait()
            with trio.move_on_after(0.2):  # give it 0.2 s more, then cancel it
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()  # train() ends here: state saved, nothing left running
        # --8<-- [end:deadline]
        stopped_at = await backend._get_step(model)
        print(f"cancelled at step {stopped_at}; running={trainer.statistics().running}")

        again = new_trainer()  # same model directory: resumes where the scope cancelled it
        with trio.move_on_after(30):  # a deadline as a cancel scope around the call itself
            again.add_observer(lambda e: isinstance(e, StepTrained) and again.request_stop())
            await again.train()
        final = await backend._get_step(model)
        print(f"resumed from step {stopped_at} and trained to step {final}")
        assert final > stopped_at >= 2


if __name__ == "__main__":
    trio.run(main)
