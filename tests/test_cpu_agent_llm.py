"""The lookup task (a two-turn agent with a slow tool) on the real model, through art_trio's
trainer under trio: its asyncio rollout runs through the trio-asyncio bridge, the tool's
latency passes between the turns, and both turns' tokens are trained.

Marked ``llm`` (deselected by default; ``pytest -m llm tests/test_cpu_agent_llm.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from tests.llm_marks import LLM_MARKS, loaded_backend, smollm2_model

pytestmark = LLM_MARKS

#: Short enough for a test, long enough to be told from decoding jitter.
LATENCY_S = 3.0


@pytest.fixture(scope="module")
def loaded() -> Any:
    return loaded_backend(keep_steps=2)


class TimedClient:
    """The real openai client, with the time each request was sent and answered."""

    def __init__(self, client: Any, log: list[tuple[float, float, dict[str, Any]]]) -> None:
        self._create = client.chat.completions.create
        self._log = log
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> Any:
        sent = time.monotonic()
        response = await self._create(**kwargs)
        self._log.append((sent, time.monotonic(), kwargs))
        return response


def _turns(trajectory: art.Trajectory) -> list[Any]:
    return [m for m in trajectory.messages_and_choices if not isinstance(m, dict)]


def test_lookup_rollouts_train_both_turns_after_the_tool_latency(
    loaded: Any, tmp_path: Path
) -> None:
    from art_trio import PipelineTrainer
    from art_trio.cpu.agent_task import (
        LookupTaskConfig,
        agent_rollout,
        lookup_eval_fn,
        lookup_messages,
        lookup_scenarios,
        parse_call,
    )

    backend = loaded
    requests: list[tuple[float, float, dict[str, Any]]] = []
    trained: list[tuple[list[art.TrajectoryGroup], dict[str, float]]] = []
    config = LookupTaskConfig(
        group_size=4, tool_latency_s=LATENCY_S, eval_prompts=1, eval_samples=1
    )

    async def rollout(
        model: art.TrainableModel, scenario: dict[str, Any], config: LookupTaskConfig
    ) -> art.TrajectoryGroup:
        # lookup_rollout's body, with the client timed: asyncio code, through the bridge.
        import asyncio

        client = TimedClient(model.openai_client(), requests)
        return art.TrajectoryGroup(
            await asyncio.gather(
                *(
                    agent_rollout(
                        client,
                        model.get_inference_name,
                        scenario["word"],
                        scenario["seed"],
                        config,
                        scenario["seed"] + 104_729 * i,
                    )
                    for i in range(config.group_size)
                )
            )
        )

    real_train = backend.train

    async def recording_train(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        result = await real_train(model, groups, **kwargs)
        trained.append((groups, dict(result.metrics)))
        return result

    async def run() -> int:
        async with backend:
            model = smollm2_model(tmp_path, "agent")
            await model.register(backend)
            trainer = PipelineTrainer(
                model,
                backend,
                rollout,
                lookup_scenarios(0),
                config,
                lookup_eval_fn,
                num_rollout_workers=2,
                min_batch_size=1,
                max_batch_size=1,
                max_steps_off_policy=2,
                learning_rate=1e-3,
                eval_every_n_steps=100,
                max_steps=2,
            )
            await trainer.train()
            return int(await backend._get_step(model))

    backend.train = recording_train
    try:
        assert trio.run(run) == 2
    finally:
        del backend.train
    assert len(trained) == 2
    called = 0
    for groups, metrics in trained:
        tokens = 0
        for trajectory in (t for g in groups for t in g.trajectories):
            turns = _turns(trajectory)
            assert len(turns) == 2  # both assistant turns, as the server's Choices
            for choice in turns:
                assert choice.logprobs is not None and choice.logprobs.content
                tokens += len(choice.logprobs.content)
            called += int(trajectory.metrics["called"])
            if trajectory.metrics["called"]:
                assert trajectory.metrics["tool_wait_s"] >= LATENCY_S
        # ART's tokenizer trained every turn's tokens, no more and no fewer.
        assert metrics["data/step_trainable_assistant_tokens"] == tokens
    assert called, "no trained trajectory called the tool"
    # Seen from the client: each conversation's second turn (seeded its first turn's seed +
    # 7919) was sent no sooner than the tool's latency after its first turn was answered,
    # where the first turn called the tool.
    first = len(lookup_messages("any"))
    answered = {r["seed"]: at for _, at, r in requests if len(r["messages"]) == first}
    waits = [
        (sent - answered[r["seed"] - 7919], parse_call(r["messages"][first]["content"]))
        for sent, _, r in requests
        if len(r["messages"]) == first + 2
    ]
    # (A conversation the run's end cancelled during its tool call has no second turn.)
    assert waits and any(call for _, call in waits)
    assert all(wait >= LATENCY_S for wait, call in waits if call is not None)
