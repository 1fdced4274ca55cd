"""Rollouts on a Ray cluster: the trainer here, the rollout function in Ray actors.

``rollout_executor=RayRolloutExecutor()`` is the only change to a trainer: admission, stop
grace and exactly-once resume hold as in-process, and a rollout whose Ray worker dies is rolled
again. This example starts a private one-machine Ray instance (``ray.init`` with 2 CPUs); on a
real cluster start Ray with ``ray start`` and let ``RayRolloutExecutor()`` join it. The policy
server must be reachable from every node (here everything is on 127.0.0.1).

Needs ``pip install 'art-trio[ray]'``. If Ray cannot start here it says so and exits.

    python examples/ray_rollouts.py          # writes under ./.art
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline
# A private instance: no token auth, so nothing is written to ~/.ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import art  # noqa: E402
import trio  # noqa: E402

from art_trio import PipelineRuntimeConfig, PipelineTrainer, trainable_model  # noqa: E402
from art_trio.demo import CpuBackend, TaskConfig, scenarios, start_over  # noqa: E402
from art_trio.demo.task import reward_for_answer  # noqa: E402

STEPS = 3


async def rollout(
    model: art.TrainableModel, scenario: dict, config: TaskConfig
) -> art.TrajectoryGroup:
    """Runs in a Ray actor, on a copy of the model: ``get_inference_name()`` names the policy
    version current when the rollout started, and ``openai_client()`` reaches its server."""
    messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, n=config.group_size,
        max_tokens=config.max_tokens, logprobs=True, seed=scenario["seed"],
    )  # fmt: skip
    tokens = response.usage.completion_tokens / len(response.choices) if response.usage else 1
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=reward_for_answer(choice.message.content or ""),
            metrics={"completion_tokens": tokens},
        )
        for choice in response.choices
    )


class RayUnavailable(RuntimeError):
    """Ray is not installed, or its local instance did not start."""


def start_ray() -> None:
    try:
        import ray

        ray.init(num_cpus=2, object_store_memory=100_000_000, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
    except Exception as error:  # ImportError, or whatever stopped the instance from starting
        raise RayUnavailable(f"{type(error).__name__}: {error}") from error


async def main() -> None:
    import ray

    from art_trio import RayRolloutExecutor  # imports ray: only with the extra installed

    model: art.TrainableModel = trainable_model(name="ray", project="examples",
                                                base_model="cpu-demo")  # fmt: skip
    start_over(model)  # every run from step 0 (the model's directory has a fixed name)
    async with CpuBackend(seed=0) as backend:
        await model.register(backend)
        # --8<-- [start:executor]
        trainer = PipelineTrainer(
            model, backend, rollout, scenarios(0), TaskConfig(),
            rollout_executor=RayRolloutExecutor(),  # joins the cluster ray.init() found
            pipeline=PipelineRuntimeConfig(num_rollout_workers=4, min_batch_size=2),
            max_steps=STEPS, learning_rate=0.05,
        )  # fmt: skip
        # --8<-- [end:executor]
        await trainer.train(handle_signals=False)
    nodes = len([n for n in ray.nodes() if n["Alive"]])
    print(f"trained {trainer.statistics().steps} steps, rollouts on {nodes} Ray node(s)")
    assert trainer.statistics().steps == STEPS


if __name__ == "__main__":
    try:
        start_ray()
    except RayUnavailable as reason:
        print(f"Ray could not start here ({reason}); nothing to show.")
        raise SystemExit(0) from None
    try:
        trio.run(main)
    finally:
        import ray

        ray.shutdown()
