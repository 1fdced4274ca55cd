"""Tasks for the real-model demo and benchmarks: yes/no/maybe, explained, reasoned, distinct,
a list, and a tool-calling agent.

``yes-no-maybe`` is ART's example task (``art_trio.cpu.demo``): two-token answers, where
training is most of a step's work. ``explain``, ``reasoned``, ``distinct`` and ``list`` are
ones where inference matters, as it does for ART's users.

**The explain task.** ART's 48 yes/no/maybe prompts with answers of up to 64 tokens, scored
as a verifiable format: the yes/no/maybe task's first-word score (maybe 1.0, no 0.75, yes 0.5,
anything else 0), halved unless at least ``EXPLAIN_WORDS`` words (about 32 tokens) follow the
first word. At step 0 SmolLM2-135M starts 13 of 64 answers with yes, no or maybe and writes
more than 24 words in 31 of 64 (8 prompts x 8 samples of up to 48 tokens), so most groups
have reward variance; a policy that learns the first word and stops there scores half, so
answers stay long. (Asking for the reason in the prompt, ", then explain why in two or three
sentences", made the model answer with yes/no/maybe in 5 of 64 instead of 13.)

**The reasoned task.** The explain task's prompts and 64-token answers, scored so that every
word of the reason counts: the verdict's score (the answer's first yes/no/maybe word, scored
as above, in full when it is the first word and halved when it comes later among the first
``VERDICT_WORDS``) times the reason's share (from 1/2 with no reason to 1 at ``EXPLAIN_WORDS``
words after the first, in proportion). A bare "no" scores 0.375, "no" with 12 words of reason
0.56, with 24 words 0.75; an answer without a verdict scores 0. On the explain task, where a
reason shorter than 24 words earned no more than none at all, both trainers' policies
learned to answer with the first word alone. At step 0 (8 prompts x 8 samples) the mean
score is 0.10 and 7 of 8 groups have reward variance (12 of 64 answers lead with a verdict,
9 more have one among their first five words).

**The distinct task.** The reasoned task's verdict and 64-token answers, but the reason's
share counts distinct words, full at ``DISTINCT_WORDS`` = 48: on the reasoned task both
trainers' policies learned to pad the reason with one word repeated ("No no no ..."), which
earns nothing here. Few 64-token answers hold 48 distinct words, so the share rarely tops out
and a group's answers rarely all score the same: groups keep their reward variance after the
verdict is learnt (1-54 zero-variance groups per 14-step benchmark run, against 6-169 on the
reasoned task). At step 0 (8 prompts x 8 samples, seed 0) the mean score is 0.06 and 6 of 8
groups have reward variance. Padding no longer pays, yet most trained policies still pad
(docs/real-model.md).

**The list task**, a short conversation with an environment that checks a format. The user
asks for exactly ``k`` things of a category (5 to 8 fruits, colors, ...), comma-separated and
nothing else. The environment counts the answer's items;
when the count or the format is off, it says what was wrong and asks again (up to ``turns``
model turns). A rollout's reward is the mean of its turns' scores, a turn that was already
right counting for the turns it saved, so getting it right at once scores 1.0 and fixing it
on the second turn scores more than never fixing it. A turn's score is graded: the share of
well-formed items (one to three words, no line breaks or list numbering) times how close the
count is to ``k`` (1 - |count - k| / k, not below 0). SmolLM2-135M mostly writes numbered
lists or prose with a few commas (score about 0.25 at step 0), so groups have reward
variance from the first step. Answers run up to ``max_tokens`` = 48 tokens per turn.

**The lookup task** (``art_trio.cpu.agent_task``), a two-turn agent: the model calls a tool
in a stated format, the tool answers after seconds of wall time, and the model answers with
what the tool said; both turns are trained.

Everything talks to the model through ``model.openai_client()`` only, as rollout code for a
vLLM backend would; nothing here imports art_trio's internals.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import Any

import art
import numpy as np

from ..demo.task import ANSWER_PUNCTUATION, REWARDS, reward_for_answer
from . import demo
from .agent_task import LookupTaskConfig, lookup_eval_fn, lookup_rollout, lookup_scenarios

#: Things the list task asks for; each scenario asks for ``k`` of one of them.
CATEGORIES: tuple[str, ...] = (
    "fruits",
    "colors",
    "animals",
    "countries",
    "vegetables",
    "sports",
    "musical instruments",
    "cities",
    "flowers",
    "kitchen tools",
    "birds",
    "jobs",
    "drinks",
    "trees",
    "school subjects",
    "vehicles",
)
#: How many items a scenario asks for.
COUNTS: tuple[int, ...] = (5, 6, 7, 8)
#: Words an item may have: longer pieces are prose, not list items.
MAX_ITEM_WORDS = 3

#: Words that must follow an explain answer's first word for full marks.
EXPLAIN_WORDS = 24
#: Distinct words of reason the distinct task gives full credit for: more than most 64-token
#: answers hold, so a group's answers rarely tie at the top.
DISTINCT_WORDS = 48
#: The reasoned task's half-credit window: a verdict among these first words counts half.
VERDICT_WORDS = 5
#: The yes/no/maybe task's punctuation, and the curly quotes SmolLM2 often writes around a
#: verdict inside a longer answer.
_PUNCTUATION = ANSWER_PUNCTUATION + "\u2018\u2019\u201c\u201d"


def score_explained(text: str) -> float:
    """The first word's yes/no/maybe score, halved unless ``EXPLAIN_WORDS`` words follow it."""
    score = reward_for_answer(text)
    return score if len(text.split()) > EXPLAIN_WORDS else score / 2


def _words(text: str) -> list[str]:
    return [word.strip(_PUNCTUATION).lower() for word in text.split()]


def _verdict(words: list[str]) -> float:
    """The first yes/no/maybe word's score: in full as the first word, half among the first
    ``VERDICT_WORDS``, 0 when there is none."""
    for position, word in enumerate(words[:VERDICT_WORDS]):
        if word in REWARDS:
            return REWARDS[word] if position == 0 else REWARDS[word] / 2
    return 0.0


def score_reasoned(text: str) -> float:
    """The verdict's score times the reason's share: the reason (the words after the first)
    earns from half credit with none to full credit at ``EXPLAIN_WORDS``."""
    words = _words(text)
    reason = min(1.0, max(0, len(words) - 1) / EXPLAIN_WORDS)
    return _verdict(words) * (1.0 + reason) / 2


def score_distinct(text: str) -> float:
    """As ``score_reasoned``, but the reason's share counts distinct words, full at
    ``DISTINCT_WORDS``: padding earns nothing, and the share rarely tops out."""
    words = _words(text)
    reason = min(1.0, len({word for word in words[1:] if word}) / DISTINCT_WORDS)
    return _verdict(words) * (1.0 + reason) / 2


_NUMBERING = re.compile(r"^\s*(\d+[.)]|[-*•])\s*")


def list_prompt(category: str, k: int) -> str:
    return f"List exactly {k} {category}, separated by commas, and nothing else."


def list_items(text: str) -> list[str]:
    """The answer's comma-separated pieces (stripped of a final period), empty ones left out."""
    body = text.strip().rstrip(".")
    return [piece.strip() for piece in body.split(",") if piece.strip()]


def _well_formed(item: str) -> bool:
    return (
        "\n" not in item and not _NUMBERING.match(item) and 1 <= len(item.split()) <= MAX_ITEM_WORDS
    )


def score_list(text: str, k: int) -> float:
    """One turn's score in [0, 1]: well-formed share x closeness of the count to ``k``."""
    items = list_items(text)
    if not items:
        return 0.0
    formed = sum(_well_formed(item) for item in items) / len(items)
    closeness = max(0.0, 1.0 - abs(len(items) - k) / k)
    return formed * closeness


def feedback(text: str, k: int) -> str:
    """What the environment tells the model after a turn that was not right."""
    items = list_items(text)
    bad = [item for item in items if not _well_formed(item)]
    parts = [f"You gave {len(items)} items; I asked for exactly {k}."]
    if bad:
        parts.append("Each item must be one to three words, with no numbering or line breaks.")
    parts.append(f"Answer again with exactly {k} items separated by commas, and nothing else.")
    return " ".join(parts)


def rollout_reward(scores: list[float], turns: int) -> float:
    """The mean over ``turns`` turns, a turn not needed (the last one was right) scoring 1."""
    done = scores[-1] >= 1.0
    padded = scores + [1.0 if done else 0.0] * (turns - len(scores))
    return sum(padded) / turns


@dataclass(frozen=True)
class ListTaskConfig:
    """The ``config`` the trainer hands to the list task's ``rollout`` and ``eval_fn``.

    Field names match ``demo.LLMTaskConfig``'s, so the demo builds either the same way.
    """

    group_size: int = 4
    max_tokens: int = 48
    #: Model turns a rollout may take (the environment answers between two).
    turns: int = 2
    eval_prompts: int = 8
    eval_samples: int = 2
    seed: int = 0
    verbose: bool = False
    started: float | None = None


def list_scenarios(seed: int = 0) -> Iterator[dict[str, Any]]:
    """Every (category, k) pair, reshuffled each epoch, the same for the same seed."""
    pairs = [(c, k) for c in CATEGORIES for k in COUNTS]
    for epoch in count():
        order = np.random.default_rng([seed, epoch, 7]).permutation(len(pairs))
        for position, index in enumerate(order):
            category, k = pairs[int(index)]
            yield {
                "prompt": list_prompt(category, k),
                "k": k,
                "seed": (seed * 1_000_003 + epoch * len(pairs) + position) % 2**31,
                "metadata": {"scenario_id": f"l{int(index):02d}", "epoch": epoch},
            }


async def _conversation(
    client: Any,
    model_name: str,
    prompt: str,
    k: int,
    config: ListTaskConfig,
    seed: int,
    first: Any,
    logprobs: bool,
) -> art.Trajectory:
    """Continue one trajectory from its first answer ``first`` until right or out of turns."""
    messages: list[Any] = [{"role": "user", "content": prompt}, first]
    text = first.message.content or ""
    scores = [score_list(text, k)]
    for turn in range(1, config.turns):
        if scores[-1] >= 1.0:
            break
        history: list[Any] = [
            m if isinstance(m, dict) else {"role": "assistant", "content": m.message.content or ""}
            for m in messages
        ]
        note = {"role": "user", "content": feedback(text, k)}
        response = await client.chat.completions.create(
            model=model_name,
            messages=[*history, note],
            n=1,
            max_tokens=config.max_tokens,
            logprobs=logprobs,
            seed=seed + 7919 * turn,
        )
        choice = response.choices[0]
        messages += [note, choice]
        text = choice.message.content or ""
        scores.append(score_list(text, k))
    return art.Trajectory(
        messages_and_choices=messages,
        reward=rollout_reward(scores, config.turns),
        metrics={"turns": len(scores), "first_turn_score": scores[0]},
    )


async def _group(
    model: art.TrainableModel,
    model_name: str,
    prompt: str,
    k: int,
    config: ListTaskConfig,
    seed: int,
    samples: int,
    logprobs: bool,
) -> list[art.Trajectory]:
    client = model.openai_client()
    response = await client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        n=samples,
        max_tokens=config.max_tokens,
        logprobs=logprobs,
        seed=seed,
    )
    # The trajectories' later turns go to the server together, as an agent's would.
    return list(
        await asyncio.gather(
            *(
                _conversation(client, model_name, prompt, k, config, seed + i, c, logprobs)
                for i, c in enumerate(response.choices)
            )
        )
    )


async def list_rollout(
    model: art.TrainableModel, scenario: dict[str, Any], config: ListTaskConfig
) -> art.TrajectoryGroup:
    """``group_size`` conversations from the newest policy, with logprobs for training."""
    name = model.get_inference_name()  # the newest step (the in-flight slot, if on)
    trajectories = await _group(
        model,
        name,
        scenario["prompt"],
        scenario["k"],
        config,
        scenario["seed"],
        config.group_size,
        True,
    )
    return art.TrajectoryGroup(trajectories)


def list_eval_pairs(config: ListTaskConfig) -> list[tuple[str, int]]:
    """Fixed (category, k) pairs spread over the categories and counts."""
    return [
        (CATEGORIES[(3 * i) % len(CATEGORIES)], COUNTS[i % len(COUNTS)])
        for i in range(config.eval_prompts)
    ]


async def list_eval_fn(
    model: art.TrainableModel, step: int, config: ListTaskConfig
) -> list[art.Trajectory | art.TrajectoryGroup]:
    """The eval pairs from ``model@step`` with fixed seeds (all sent at once)."""
    name = model.get_inference_name(step)
    groups = await asyncio.gather(
        *(
            _group(
                model,
                name,
                list_prompt(category, k),
                k,
                config,
                config.seed * 1_000_003 + 7919 * i + 1,
                config.eval_samples,
                False,
            )
            for i, (category, k) in enumerate(list_eval_pairs(config))
        )
    )
    trajectories: list[art.Trajectory | art.TrajectoryGroup] = [t for g in groups for t in g]
    demo.report_val_reward(config, step, trajectories)
    return trajectories


@dataclass(frozen=True)
class LLMTask:
    """A task the demo and the benchmarks can run: its pieces and the settings it suits."""

    name: str
    description: str
    config: Callable[..., Any]
    scenarios: Callable[[int], Iterator[dict[str, Any]]]
    rollout: Callable[[art.TrainableModel, dict[str, Any], Any], Awaitable[art.TrajectoryGroup]]
    eval_fn: Callable[
        [art.TrainableModel, int, Any], Awaitable[list[art.Trajectory | art.TrajectoryGroup]]
    ]
    #: Completions per group the task is meant to run with.
    group_size: int
    #: The reward the benchmarks' "time to target" waits for: the mean reward of a step's
    #: trained groups (stated before the task was measured, see docs/real-model.md).
    reward_target: float
    #: ``LLMDemoOptions`` fields the demo takes from the task unless given on the command line
    #: (a task whose rollouts outlast steps needs more workers and a looser bound).
    demo_defaults: Mapping[str, Any] = field(default_factory=dict)


def _on_art_prompts(name: str, description: str, **config: Any) -> LLMTask:
    """A single-turn task on ART's yes/no/maybe prompts (``art_trio.cpu.demo``): ``config``
    sets its answer length and score."""
    return LLMTask(
        name=name,
        description=description,
        config=partial(demo.LLMTaskConfig, **config),
        scenarios=demo.scenarios,
        rollout=demo.rollout,
        eval_fn=demo.eval_fn,
        group_size=8,
        reward_target=0.5,
    )


TASKS: dict[str, LLMTask] = {
    "yes-no-maybe": _on_art_prompts(
        "yes-no-maybe", "ART's yes/no/maybe prompts, two-token answers"
    ),
    "explain": _on_art_prompts(
        "explain",
        "yes/no/maybe, then a reason of >= 24 words, in up to 64 tokens",
        max_tokens=64,
        score=score_explained,
    ),
    "reasoned": _on_art_prompts(
        "reasoned",
        "the yes/no/maybe verdict's score times a reason's share, full at 24 words",
        max_tokens=64,
        score=score_reasoned,
    ),
    "distinct": _on_art_prompts(
        "distinct",
        "as reasoned, the reason's share counting distinct words, full at 48",
        max_tokens=64,
        score=score_distinct,
    ),
    "list": LLMTask(
        name="list",
        description="exactly k comma-separated items, up to 2 turns of 48 tokens with feedback",
        config=ListTaskConfig,
        scenarios=list_scenarios,
        rollout=list_rollout,
        eval_fn=list_eval_fn,
        group_size=4,
        reward_target=0.5,
    ),
    "lookup": LLMTask(
        name="lookup",
        description="an agent: call lookup(<word>), wait seconds for the tool, answer with "
        "its number; 2 turns, both trained",
        config=LookupTaskConfig,
        scenarios=lookup_scenarios,
        rollout=lookup_rollout,
        eval_fn=lookup_eval_fn,
        group_size=4,
        # The untrained policy already scores 0.54 (a right call alone earns 0.4): three
        # quarters needs the tool's number in most answers.
        reward_target=0.75,
        # A rollout that calls the tool spans two or three steps: more rollouts in flight, and
        # a bound they can meet (ART's own default is 4).
        demo_defaults={
            # Measured: by step 5 most groups score all alike (every turn right), so steps
            # then come slowly (35 s rollouts that teach nothing); 6 steps end within 10 min.
            "steps": 6,
            "workers": 6,
            "max_steps_off_policy": 3,
            "eval_every": 3,
            "eval_prompts": 16,
            "eval_samples": 2,
        },
    ),
}


def get_task(name: str) -> LLMTask:
    """The task called ``name``; a clear error listing the known ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}"
        ) from None


__all__ = [
    "EXPLAIN_WORDS",
    "TASKS",
    "LLMTask",
    "ListTaskConfig",
    "feedback",
    "get_task",
    "list_eval_fn",
    "list_items",
    "list_rollout",
    "list_scenarios",
    "rollout_reward",
    "score_distinct",
    "score_explained",
    "score_list",
    "score_reasoned",
]
