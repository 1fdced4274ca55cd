"""An ART ``PipelineTrainer`` script, moved to art_trio by changing one import.

Written the way ART's own pipeline examples are: plain asyncio, ``asyncio.run(main())``,
a rollout function and an eval function that talk to the policy through
``model.openai_client()``, and ART's trainer keyword arguments. The one line that changed is
marked ``# was:``; art_trio's trainer runs on the script's asyncio loop as ART's does.

Only the backend differs from a GPU script, so that this runs anywhere: the numpy demo's
``CpuBackend`` (an ART backend serving a tiny policy through a real OpenAI-compatible server on
127.0.0.1) stands where ``LocalBackend()`` or ``TinkerNativeBackend()`` would.

    python examples/art_script.py            # writes under ./.art
"""

from __future__ import annotations

import asyncio
import os
import re
from functools import partial
from itertools import cycle

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # keep ART's import offline

import art  # noqa: E402

# --8<-- [start:import]
from art_trio import PipelineTrainer  # was: from art.pipeline_trainer import PipelineTrainer

# --8<-- [end:import]
# isort: split
from art_trio import trainable_model  # noqa: E402
from art_trio.demo import CpuBackend, start_over  # noqa: E402

GROUP_SIZE = 8
MAX_STEPS = 3
WORDS = ("yes", "no", "maybe")


def prompts() -> list[dict[str, str]]:
    """Ask for one of the three words, in a few phrasings."""
    return [
        {"prompt": f"{verb} {a}, {b} or {c}"}
        for verb in ("respond with", "answer with", "say")
        for a, b, c in [WORDS, WORDS[::-1], (WORDS[1], WORDS[2], WORDS[0])]
    ]


def score(text: str) -> float:
    words = re.findall(r"[a-z]+", text.lower())
    return {"maybe": 1.0, "no": 0.75, "yes": 0.5}.get(words[0] if words else "", 0.0)


async def rollout_fn(
    model: art.TrainableModel, scenario: dict, _config: None
) -> art.TrajectoryGroup:
    messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, n=GROUP_SIZE, max_tokens=5
    )
    # ART 0.5.20+ weighs policy age by tokens: record each answer's share of the usage.
    tokens = response.usage.completion_tokens / len(response.choices) if response.usage else 1
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*messages, c],
            reward=score(c.message.content or ""),
            metrics={"completion_tokens": tokens},
        )
        for c in response.choices
    )


async def eval_fn(
    model: art.TrainableModel, step: int, _config: None, *, scenarios: list[dict]
) -> list[art.Trajectory]:
    client = model.openai_client()
    trajectories = []
    for scenario in scenarios:
        messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
        response = await client.chat.completions.create(
            model=model.get_inference_name(step), messages=messages, max_tokens=5
        )
        choice = response.choices[0]
        trajectories.append(
            art.Trajectory(messages_and_choices=[*messages, choice],
                           reward=score(choice.message.content or ""))
        )  # fmt: skip
    return trajectories


async def main() -> None:
    async with CpuBackend(seed=0) as backend:  # a GPU script: backend = LocalBackend()
        # ART 0.5.20+ wants run_name= as well, 0.5.18 refuses it: this helper fits either.
        model = trainable_model(name="art-script", project="examples", base_model="cpu-demo")
        start_over(model)  # every run from step 0 (the model's directory has a fixed name)
        await model.register(backend)
        trainer = PipelineTrainer(
            model=model,
            backend=backend,
            rollout_fn=rollout_fn,
            scenarios=cycle(prompts()),
            config=None,
            learning_rate=0.05,
            loss_fn="cispo",
            eval_fn=partial(eval_fn, scenarios=prompts()[:6]),
            max_steps=MAX_STEPS,
            eval_every_n_steps=2,
            eval_at_start=False,
        )
        await trainer.train()
        if trainer.stop_signal:  # Ctrl-C (or SIGTERM) stopped it cleanly, state saved:
            raise SystemExit(128 + trainer.stop_signal)  # exit as an interrupted program (130)
    print(f"trained to step {await model.get_step()}")


if __name__ == "__main__":
    asyncio.run(main())
