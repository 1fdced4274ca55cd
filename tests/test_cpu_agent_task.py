"""The lookup task's pure parts (no model loaded): parsing the tool call, the tool and its
latency, scoring, scenarios, and the agent rollout against a scripted openai client.
tests/test_cpu_agent_llm.py runs it on the model through the trainer."""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from openai.types.chat import ChatCompletionMessage  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402

from art_trio.cpu import agent_task  # noqa: E402
from art_trio.cpu.agent_task import (  # noqa: E402
    ANSWER_WORDS,
    WORDS,
    LookupTaskConfig,
    ToolCall,
    agent_rollout,
    lookup_eval_fn,
    lookup_messages,
    lookup_prompt,
    lookup_reward,
    lookup_scenarios,
    parse_call,
    run_tool,
    score_answer,
    score_call,
    secret_number,
)
from art_trio.cpu.tasks import TASKS  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_a_call_alone_and_a_call_in_prose() -> None:
    assert parse_call("lookup(apple)") == ToolCall("apple", alone=True)
    assert parse_call("  `lookup(Apple)`.\n") == ToolCall("apple", alone=True)
    assert parse_call('lookup("apple")') == ToolCall("apple", alone=True)
    assert parse_call("LOOKUP( 'river' )") == ToolCall("river", alone=True)
    assert parse_call("Sure! I will call lookup(apple) now.") == ToolCall("apple", alone=False)
    assert parse_call("lookup(apple) lookup(river)") == ToolCall("apple", alone=False)
    assert parse_call("The secret number is 42.") is None
    assert parse_call("lookup()") is None
    assert parse_call("lookup(123)") is None


def test_secret_numbers_are_keyed_and_cannot_be_guessed() -> None:
    assert secret_number("apple", 5) == secret_number("Apple", 5)
    numbers = {secret_number("apple", key) for key in range(200)}
    assert all(100 <= n <= 999 for n in numbers)
    assert len(numbers) > 150  # a number per scenario, not per word
    # Each word its own number in a scenario.
    assert sum(secret_number("apple", k) != secret_number("river", k) for k in range(50)) > 45


def test_the_tool_answers_after_its_latency_and_a_missing_call_at_once() -> None:
    async def timed(call: ToolCall | None, latency: float) -> tuple[str, float]:
        start = time.monotonic()
        reply = await run_tool(call, 3, latency)
        return reply, time.monotonic() - start

    reply, took = asyncio.run(timed(ToolCall("apple", alone=True), 0.2))
    assert reply == f"lookup(apple) = {secret_number('apple', 3)}"
    assert took >= 0.2
    reply, took = asyncio.run(timed(None, 5.0))
    assert "No tool call found" in reply and "lookup(<word>)" in reply
    assert took < 1.0


def test_scores_are_graded() -> None:
    assert score_call(ToolCall("apple", True), "apple") == (1.0, 1.0)
    assert score_call(ToolCall("apple", False), "Apple") == (0.5, 1.0)
    assert score_call(ToolCall("river", True), "apple") == (1.0, 0.0)
    assert score_call(None, "apple") == (0.0, 0.0)
    assert score_answer("417", 417) == 1.0
    assert score_answer("The secret number of apple is 417.", 417) == 1.0
    wordy = "The secret number of the word apple, as the tool told me, is 417."
    assert len(wordy.split()) > ANSWER_WORDS and score_answer(wordy, 417) == 0.75
    assert score_answer("It is 12, or rather 417", 417) == 0.5
    assert score_answer("4170", 417) == 0.0
    assert score_answer("I do not know.", 417) == 0.0


def test_the_reward_needs_the_tools_answer_for_most_of_its_credit() -> None:
    number = secret_number("apple", 9)
    right = ToolCall("apple", alone=True)
    assert lookup_reward(right, "apple", str(number), 9) == pytest.approx(1.0)
    assert lookup_reward(right, "apple", "I don't know", 9) == pytest.approx(0.4)
    assert lookup_reward(ToolCall("apple", False), "apple", "?", 9) == pytest.approx(0.3)
    # The wrong word's number is not the asked word's.
    wrong = secret_number("river", 9)
    assert wrong != number
    assert lookup_reward(ToolCall("river", True), "apple", str(wrong), 9) == pytest.approx(0.2)
    assert lookup_reward(None, "apple", "42", 9) == 0.0


def test_scenarios_are_seeded_and_cover_every_word() -> None:
    first = list(islice(lookup_scenarios(3), len(WORDS)))
    assert first == list(islice(lookup_scenarios(3), len(WORDS)))
    assert first != list(islice(lookup_scenarios(4), len(WORDS)))
    assert {s["word"] for s in first} == set(WORDS)
    assert len({s["seed"] for s in islice(lookup_scenarios(3), 3 * len(WORDS))}) == 3 * len(WORDS)


class ScriptedClient:
    """An openai-shaped client that plays a perfect agent: the call, then the tool's number.
    Records when each request arrived and how many messages it carried."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, int, str]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, *, model: str, messages: list[Any], **_: Any) -> Any:
        self.requests.append((time.monotonic(), len(messages), model))
        last = messages[-1]["content"]
        found = re.search(r"= (\d+)", last)
        if found:
            text = f"The secret number is {found[1]}."
        else:
            word = re.search(r'"(\w+)"', last)
            text = f"lookup({word[1] if word else '?'})"
        message = ChatCompletionMessage(role="assistant", content=text)
        return SimpleNamespace(choices=[Choice(index=0, finish_reason="stop", message=message)])


def test_the_agent_rollout_has_two_trained_turns_and_waits_for_the_tool() -> None:
    client = ScriptedClient()
    names = iter(["m@0", "m@1"])  # a publish between the turns: turn 2 asks for the newest
    config = LookupTaskConfig(tool_latency_s=0.3)
    trajectory = asyncio.run(
        agent_rollout(client, lambda: next(names), "apple", 11, config, seed=5, logprobs=False)
    )
    chosen = [m for m in trajectory.messages_and_choices if isinstance(m, Choice)]
    assert len(chosen) == 2  # both assistant turns are Choices: ART trains both
    # The rest are the prompt's messages (the example's turns too, not trained) and the tool's.
    assert [m for m in trajectory.messages_and_choices if isinstance(m, dict)] == [
        *lookup_messages("apple"),
        trajectory.messages_and_choices[-2],
    ]
    (t1, n1, m1), (t2, n2, m2) = client.requests
    # Turn 2 sees turn 1's conversation, what it said and the tool's answer.
    assert (n1, n2) == (len(lookup_messages("apple")), n1 + 2) and (m1, m2) == ("m@0", "m@1")
    assert t2 - t1 >= 0.3 and trajectory.metrics["tool_wait_s"] >= 0.3
    assert trajectory.reward == pytest.approx(1.0)
    assert trajectory.metrics["called"] == 1.0 and trajectory.metrics["answered"] == 1.0
    note = trajectory.messages_and_choices[-2]
    assert isinstance(note, dict)
    assert f"= {secret_number('apple', 11)}" in note["content"]


def test_the_eval_asks_a_fixed_step() -> None:
    client = ScriptedClient()
    model = SimpleNamespace(
        openai_client=lambda: client, get_inference_name=lambda step=None: f"m@{step}"
    )
    config = LookupTaskConfig(tool_latency_s=0.0, eval_prompts=3, eval_samples=2)
    trajectories = asyncio.run(lookup_eval_fn(model, 4, config))  # type: ignore[arg-type]
    assert len(trajectories) == 6
    assert {name for _, _, name in client.requests} == {"m@4"}
    assert all(t.reward == pytest.approx(1.0) for t in trajectories)  # type: ignore[union-attr]


def test_the_task_is_registered_with_its_demo_settings() -> None:
    task = TASKS["lookup"]
    config = task.config(group_size=4, seed=1, eval_prompts=2, eval_samples=1)
    assert config.tool_latency_s == agent_task.DEFAULT_TOOL_LATENCY_S
    assert task.demo_defaults["max_steps_off_policy"] >= 3  # rollouts span two steps or more
    assert "apple" in lookup_prompt("apple")
    assert "lookup(<word>)" in lookup_messages("apple")[0]["content"]  # the stated format


def test_the_docs_show_the_rollout_as_it_is() -> None:
    """docs/agent-task.md's Python blocks are the rollout's own source, which the tests above
    run: the page cannot drift from the code."""
    page = (DOCS / "agent-task.md").read_text()
    blocks = re.findall(
        r"^<!-- [^\n]*?tests/test_cpu_agent_task\.py runs this block -->\n```python\n(.*?)^```",
        page,
        re.MULTILINE | re.DOTALL,
    )
    sources = [inspect.getsource(agent_rollout), inspect.getsource(agent_task.lookup_rollout)]
    assert blocks == sources
