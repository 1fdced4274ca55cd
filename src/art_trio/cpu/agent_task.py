"""The lookup task: a two-turn agent whose tool takes seconds of wall time to answer.

The user asks for the secret number of a word. Nobody but the tool knows it (it is drawn
afresh for every scenario), so the agent has to call the tool in the stated format,
``lookup(<word>)``, wait for its answer, and then answer with the number it was given:

1. **Turn 1** (the model): a tool call. The environment parses it and runs the tool, which
   answers after ``tool_latency_s`` seconds of wall time (an ``asyncio.sleep``, as a search, a
   database or a browser would take); a turn with no call gets an immediate note saying how to
   call, as a tool-calling harness's parser would.
2. **Turn 2** (the model): the answer, given the tool's result (or the note) as the next user
   message.

Every rollout has both turns, and both are trained: the trajectory holds both assistant
``Choice`` objects in ``messages_and_choices``, which ART's tokenizer trains (the list task's
multi-choice form).

**The reward** is graded so that groups differ from the first step: 0.2 for the call's format
(the turn is the call alone: 1; a call inside other text: 1/2), 0.2 for calling it on the
asked word, and 0.6 for the answer (the tool's number as the answer's first number, in at most
``ANSWER_WORDS`` words: 1; first but wordier: 3/4; anywhere: 1/2). A guess cannot earn the
answer's share: the number is one of 900.

**The latency.** A training call on this task's batches (2 groups of 4) took 11-16 s on the two
CPU cores (as the 64-token tasks' 11-13 s in docs/real-model.md; 2 groups of 8 took 20-29 s),
so the default tool latency, ``DEFAULT_TOOL_LATENCY_S`` = 30 s, makes a rollout that calls the
tool outlast two training calls: the case where a pipeline trainer's choice to cancel, wait or
carry on under the new policy decides what inference costs.

The rollout is what an ART user writes for an agent: asyncio code that talks to the model only
through the real openai client from ``model.openai_client()`` and asks
``model.get_inference_name()`` before each turn, so a turn sampled after a publish uses the
newest policy. Under art_trio's trainer on trio it runs through the trio-asyncio bridge,
``asyncio.sleep`` included.
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

import art
import numpy as np

from .demo import report_val_reward

#: The words the task asks about; each scenario asks for one word's secret number.
WORDS: tuple[str, ...] = (
    "apple",
    "river",
    "candle",
    "garden",
    "pencil",
    "window",
    "rocket",
    "forest",
    "bridge",
    "castle",
    "tiger",
    "planet",
    "mirror",
    "basket",
    "island",
    "ladder",
    "orange",
    "silver",
    "dragon",
    "pillow",
    "violin",
    "anchor",
    "meadow",
    "lantern",
    "button",
    "harbor",
    "falcon",
    "marble",
    "thunder",
    "cactus",
    "blanket",
    "compass",
)
#: The tool's name: a call is ``lookup(<word>)``.
TOOL = "lookup"
#: Seconds the tool takes to answer by default: a rollout that calls it then outlasts two
#: training calls (11-16 s each for 2 groups of 4 on two CPU cores), with its turns' decoding.
DEFAULT_TOOL_LATENCY_S = 30.0
#: Words an answer may have for full credit: the number, or a short sentence around it.
ANSWER_WORDS = 8

#: The reward's shares: the call's format, its argument, the answer.
FORMAT_SHARE = 0.2
ARGUMENT_SHARE = 0.2
ANSWER_SHARE = 0.6

#: A call in the stated format; the argument may be quoted, as models often write it.
_CALL = re.compile(rf"\b{TOOL}\s*\(\s*[\"'`]?\s*([A-Za-z][A-Za-z -]*?)\s*[\"'`]?\s*\)", re.I)
_NUMBER = re.compile(r"\d+")
#: What may surround a call that is alone in its turn: code fences, quotes, a final period.
_WRAPPING = " \t\n`\"'.*"


#: The tool as the system prompt states it.
SYSTEM_PROMPT = (
    f"You are an assistant with one tool, {TOOL}. To use it, reply with {TOOL}(<word>) and "
    "nothing else. The tool replies with the word's secret number."
)
#: The worked example the conversation starts with (a word the task never asks about).
EXAMPLE_WORD, EXAMPLE_NUMBER = "cat", 123


def lookup_prompt(word: str) -> str:
    """The question of turn 1."""
    return f'What is the secret number of the word "{word}"?'


def lookup_messages(word: str) -> art.Messages:
    """The conversation up to turn 1: the tool's description, one worked exchange, then the
    question. SmolLM2-135M given the description alone called the tool in 1-3 of 64 first
    turns (it chatted instead); with the example, in 48 of 64, so groups differ from step 0."""
    call = f"{TOOL}({EXAMPLE_WORD})"
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": lookup_prompt(EXAMPLE_WORD)},
        {"role": "assistant", "content": call},
        {"role": "user", "content": tool_message(EXAMPLE_WORD, f"{call} = {EXAMPLE_NUMBER}")},
        {"role": "assistant", "content": str(EXAMPLE_NUMBER)},
        {"role": "user", "content": lookup_prompt(word)},
    ]


def secret_number(word: str, key: int) -> int:
    """The number the tool gives for ``word`` in the scenario keyed ``key``: 100-999, the
    same for the same pair, unrelated across keys (so it cannot be learnt, only looked up)."""
    rng = np.random.default_rng([key % 2**32, zlib.crc32(word.lower().encode())])
    return int(rng.integers(100, 1000))


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: its argument, and whether the turn held nothing else."""

    argument: str
    alone: bool


def parse_call(text: str) -> ToolCall | None:
    """The first ``lookup(...)`` call in ``text``, or None."""
    match = _CALL.search(text)
    if match is None:
        return None
    alone = text.strip(_WRAPPING) == match.group(0).strip(_WRAPPING)
    return ToolCall(argument=match.group(1).strip().lower(), alone=alone)


async def run_tool(call: ToolCall | None, key: int, latency_s: float) -> str:
    """The environment's reply to turn 1: the tool's result after ``latency_s`` seconds of
    wall time, or at once a note saying how to call it."""
    if call is None:
        return f"No tool call found. The tool is called as {TOOL}(<word>)."
    await asyncio.sleep(latency_s)
    return f"{TOOL}({call.argument}) = {secret_number(call.argument, key)}"


def tool_message(word: str, result: str) -> str:
    """The user message that carries the tool's result into turn 2."""
    return f'{result}\nNow answer: what is the secret number of "{word}"? Reply with the number.'


def score_call(call: ToolCall | None, word: str) -> tuple[float, float]:
    """Turn 1's (format, argument) scores, each in [0, 1]."""
    if call is None:
        return 0.0, 0.0
    return (1.0 if call.alone else 0.5), float(call.argument == word.lower())


def score_answer(text: str, number: int) -> float:
    """Turn 2's score: 1 for ``number`` as the first number in at most ``ANSWER_WORDS`` words,
    3/4 first but wordier, 1/2 anywhere, else 0."""
    numbers = _NUMBER.findall(text)
    if str(number) not in numbers:
        return 0.0
    if numbers[0] != str(number):
        return 0.5
    return 1.0 if len(text.split()) <= ANSWER_WORDS else 0.75


def lookup_reward(call: ToolCall | None, word: str, answer: str, key: int) -> float:
    """The rollout's reward in [0, 1]. The answer is scored against the asked word's number:
    a call on another word returns another number, which earns nothing."""
    form, argument = score_call(call, word)
    answered = score_answer(answer, secret_number(word, key))
    return FORMAT_SHARE * form + ARGUMENT_SHARE * argument + ANSWER_SHARE * answered


@dataclass(frozen=True)
class LookupTaskConfig:
    """The ``config`` the trainer hands to the lookup task's ``rollout`` and ``eval_fn``.

    Field names match ``demo.LLMTaskConfig``'s, so the demo builds either the same way.
    """

    group_size: int = 4
    #: Tokens per model turn: a call or a number needs a handful.
    max_tokens: int = 24
    tool_latency_s: float = DEFAULT_TOOL_LATENCY_S
    eval_prompts: int = 8
    eval_samples: int = 2
    seed: int = 0
    verbose: bool = False
    started: float | None = None


def lookup_scenarios(seed: int = 0) -> Iterator[dict[str, Any]]:
    """Every word once per epoch, reshuffled each epoch; each scenario's secret numbers are
    keyed by its own seed. The same stream for the same ``seed``."""
    for epoch in count():
        order = np.random.default_rng([seed, epoch, 53]).permutation(len(WORDS))
        for position, index in enumerate(order):
            yield {
                "word": WORDS[int(index)],
                "seed": (seed * 1_000_003 + epoch * len(WORDS) + position) % 2**31,
                "metadata": {"scenario_id": f"w{int(index):02d}", "epoch": epoch},
            }


async def _turn(
    client: Any,
    model_name: str,
    messages: art.Messages,
    config: LookupTaskConfig,
    seed: int,
    logprobs: bool,
) -> Any:
    response = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        n=1,
        max_tokens=config.max_tokens,
        logprobs=logprobs,
        seed=seed,
    )
    return response.choices[0]


async def agent_rollout(
    client: Any,
    model_name: Callable[[], str],
    word: str,
    key: int,
    config: LookupTaskConfig,
    seed: int,
    logprobs: bool = True,
) -> art.Trajectory:
    """One agent conversation: the call, the tool's answer, the answer; both turns trained.

    ``model_name()`` is asked before each turn: the newest policy when the rollout trains,
    a fixed step when it evaluates.
    """
    prompt = lookup_messages(word)
    first = await _turn(client, model_name(), prompt, config, seed, logprobs)
    call = parse_call(first.message.content or "")
    asked = time.monotonic()
    result = await run_tool(call, key, config.tool_latency_s)
    waited = time.monotonic() - asked
    said: art.Messages = [{"role": "assistant", "content": first.message.content or ""}]
    note: art.Messages = [{"role": "user", "content": tool_message(word, result)}]
    second = await _turn(client, model_name(), prompt + said + note, config, seed + 7919, logprobs)
    answer = second.message.content or ""
    return art.Trajectory(
        # Both turns as the Choices the server returned: ART trains every Choice's tokens.
        messages_and_choices=[*prompt, first, *note, second],
        reward=lookup_reward(call, word, answer, key),
        metrics={
            "called": float(call is not None),
            "right_argument": score_call(call, word)[1],
            "answered": float(score_answer(answer, secret_number(word, key)) > 0),
            "tool_wait_s": waited,
        },
    )


async def lookup_rollout(
    model: art.TrainableModel, scenario: dict[str, Any], config: LookupTaskConfig
) -> art.TrajectoryGroup:
    """``group_size`` agent conversations on one scenario, each on its own, at once."""
    client = model.openai_client()
    trajectories = await asyncio.gather(
        *(
            agent_rollout(
                client,
                model.get_inference_name,  # the newest step at each turn
                scenario["word"],
                scenario["seed"],
                config,
                scenario["seed"] + 104_729 * i,
            )
            for i in range(config.group_size)
        )
    )
    return art.TrajectoryGroup(trajectories)


def lookup_eval_words(config: LookupTaskConfig) -> list[str]:
    """Fixed words spread over the list."""
    stride = max(1, len(WORDS) // max(1, config.eval_prompts))
    return list(WORDS[::stride][: config.eval_prompts])


async def lookup_eval_fn(
    model: art.TrainableModel, step: int, config: LookupTaskConfig
) -> list[art.Trajectory | art.TrajectoryGroup]:
    """The eval words from ``model@step`` with fixed keys and seeds, all at once."""
    client = model.openai_client()
    name = model.get_inference_name(step)
    runs = [
        agent_rollout(
            client,
            lambda: name,
            word,
            config.seed * 1_000_003 + 7919 * i + 1,
            config,
            config.seed * 1_000_003 + 7919 * i + 104_729 * j + 1,
            logprobs=False,
        )
        for i, word in enumerate(lookup_eval_words(config))
        for j in range(config.eval_samples)
    ]
    trajectories: list[art.Trajectory | art.TrajectoryGroup] = list(await asyncio.gather(*runs))
    report_val_reward(config, step, trajectories)
    return trajectories


__all__ = [
    "DEFAULT_TOOL_LATENCY_S",
    "TOOL",
    "WORDS",
    "LookupTaskConfig",
    "ToolCall",
    "agent_rollout",
    "lookup_eval_fn",
    "lookup_prompt",
    "lookup_reward",
    "lookup_rollout",
    "lookup_scenarios",
    "parse_call",
    "run_tool",
    "score_answer",
    "score_call",
    "secret_number",
    "tool_message",
]
