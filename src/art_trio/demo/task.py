"""The yes/no/maybe task of ART's pipeline example, written as a GPU user would write it.

``rollout`` and ``eval_fn`` are plain asyncio code that only talk to the model through
``model.openai_client()``: they would run unchanged against a vLLM or Tinker backend. The
reward is ART's: the first word ``maybe`` scores 1.0, ``no`` 0.75, ``yes`` 0.5, anything else 0,
so the optimum is to always answer "maybe" (1.0), and a policy uniform over the three scores
0.75.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count, permutations
from typing import Any, TypeAlias

import art
import numpy as np

REWARDS: dict[str, float] = {"maybe": 1.0, "no": 0.75, "yes": 0.5}


Scenario: TypeAlias = dict[str, Any]
"""One prompt: ``{"prompt": str, "seed": int, "metadata": {"scenario_id": str, "epoch": int}}``.
The trainer copies ``metadata`` onto the group; ``seed`` makes the group's sampling repeatable.
(A plain dict, not a TypedDict, because the trainer's scenarios are ``dict[str, Any]``.)"""


@dataclass(frozen=True)
class TaskConfig:
    """The ``config`` the trainer hands to ``rollout`` and ``eval_fn``."""

    #: Completions per rollout group (one request with ``n=group_size``).
    group_size: int = 8
    #: Completions per eval prompt; the val reward averages 48 * eval_samples answers.
    eval_samples: int = 8
    max_tokens: int = 5
    seed: int = 0


def build_prompts() -> list[str]:
    """ART's 48 prompts: "respond with yes, no, maybe", "just respond with 'no' or 'yes'"..."""
    prompts: list[str] = []
    for prefix in ["respond", "just respond"]:
        for use_quotes in [True, False]:
            for n in [3, 2]:
                for words in permutations(["yes", "no", "maybe"], n):
                    quoted = [f"'{w}'" if use_quotes else w for w in words]
                    body = ", ".join(quoted) if len(words) == 3 else " or ".join(quoted)
                    prompts.append(f"{prefix} with {body}")
    return prompts


def scenarios(seed: int = 0) -> Iterator[Scenario]:
    """An endless stream of the prompts, reshuffled each epoch, the same for the same seed."""
    prompts = build_prompts()
    for epoch in count():
        order = np.random.default_rng([seed, epoch]).permutation(len(prompts))
        for position, index in enumerate(order):
            yield {
                "prompt": prompts[int(index)],
                "seed": (seed * 1_000_003 + epoch * len(prompts) + position) % 2**31,
                "metadata": {"scenario_id": f"p{int(index):02d}", "epoch": epoch},
            }


#: What is stripped from an answer's words before they are compared with ``REWARDS``.
ANSWER_PUNCTUATION = ".,!?:;\"'()[]{}"


def reward_for_answer(text: str) -> float:
    """Score the first word of an answer: maybe=1.0, no=0.75, yes=0.5, other=0.0."""
    if not text:
        return 0.0
    first_word = re.split(r"\s+", text.strip().lower())[0].strip(ANSWER_PUNCTUATION)
    return REWARDS.get(first_word, 0.0)


async def current_inference_name(model: art.TrainableModel) -> str:
    """The ``name@step`` of the newest policy: a rollout should sample from the version that is
    current when it starts (the trainer stamps that version on the group)."""
    return model.get_inference_name(await model.get_step())


async def rollout(
    model: art.TrainableModel, scenario: Scenario, config: TaskConfig
) -> art.TrajectoryGroup:
    """One request with ``n=group_size`` answers from the current policy, with logprobs."""
    messages: art.Messages = [{"role": "user", "content": scenario["prompt"]}]
    response = await model.openai_client().chat.completions.create(
        model=await current_inference_name(model),
        messages=messages,
        n=config.group_size,
        max_tokens=config.max_tokens,
        logprobs=True,
        seed=scenario["seed"],
    )
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=reward_for_answer(choice.message.content or ""),
        )
        for choice in response.choices
    )


async def eval_fn(
    model: art.TrainableModel, step: int, config: TaskConfig
) -> list[art.Trajectory | art.TrajectoryGroup]:
    """Every prompt, ``eval_samples`` answers each, from ``model@step``, with fixed seeds so a
    step's val reward depends only on its weights."""
    client = model.openai_client()
    name = model.get_inference_name(step)
    trajectories: list[art.Trajectory | art.TrajectoryGroup] = []
    for index, prompt in enumerate(build_prompts()):
        messages: art.Messages = [{"role": "user", "content": prompt}]
        response = await client.chat.completions.create(
            model=name,
            messages=messages,
            n=config.eval_samples,
            max_tokens=config.max_tokens,
            seed=config.seed * 1_000_003 + 7919 * index + 1,
        )
        trajectories.extend(
            art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward=reward_for_answer(choice.message.content or ""),
            )
            for choice in response.choices
        )
    return trajectories
