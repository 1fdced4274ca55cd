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


def _train_lookup(
    backend: Any,
    tmp_path: Path,
    name: str,
    rollout: Any,
    config: Any,
    record: Any,
    *,
    seed: int,
    max_steps_off_policy: int,
    steps: int,
) -> int:
    """Train model `name` on the lookup task for `steps` steps under `trio.run` (the asyncio
    rollout through the bridge), `record(groups, result)` told of each `backend.train`; the
    backend's step after. With in-flight updates on, rollouts sample the in-flight slot."""
    from art_trio import PipelineTrainer
    from art_trio.cpu.agent_task import lookup_eval_fn, lookup_scenarios

    real_train = backend.train

    async def recording_train(model: Any, groups: Any, **kwargs: Any) -> Any:
        groups = list(groups)
        result = await real_train(model, groups, **kwargs)
        record(groups, result)
        return result

    async def run() -> int:
        async with backend:
            model = smollm2_model(tmp_path, name)
            await model.register(backend)
            if backend.in_flight_updates:
                assert model.get_inference_name().endswith(":active")
            trainer = PipelineTrainer(
                model,
                backend,
                rollout,
                lookup_scenarios(seed),
                config,
                lookup_eval_fn,
                num_rollout_workers=2,
                min_batch_size=1,
                max_batch_size=1,
                max_steps_off_policy=max_steps_off_policy,
                learning_rate=1e-3,
                eval_every_n_steps=100,
                max_steps=steps,
            )
            await trainer.train()
            return int(await backend._get_step(model))

    backend.train = recording_train
    try:
        return trio.run(run)
    finally:
        del backend.train


def test_lookup_rollouts_train_both_turns_after_the_tool_latency(
    loaded: Any, tmp_path: Path
) -> None:
    from art_trio.cpu.agent_task import (
        LookupTaskConfig,
        agent_rollout,
        lookup_messages,
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

    def record(groups: list[art.TrajectoryGroup], result: Any) -> None:
        trained.append((groups, dict(result.metrics)))

    step = _train_lookup(
        backend, tmp_path, "agent", rollout, config, record,
        seed=0, max_steps_off_policy=2, steps=2,
    )  # fmt: skip
    assert step == 2
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


@pytest.fixture(scope="module")
def in_flight() -> Any:
    return loaded_backend(keep_steps=4, in_flight_updates=True)


def _versions(choice: Any) -> list[tuple[int, int]]:
    """(tokens, policy version) of each span of a served choice."""
    return [
        (s["end_token"] - s["start_token"], s["policy_version"])
        for s in choice.model_extra["policy_token_spans"]
    ]


def test_with_in_flight_updates_a_turn_after_a_publish_uses_the_newest_policy(
    in_flight: Any, tmp_path: Path
) -> None:
    """Issue 53 item 2's first part: with `CPUBackend(in_flight_updates=True)` the rollout's
    `model.get_inference_name()` is the in-flight slot, so a second turn sent after a step
    was published is sampled by that step; each turn's tokens carry their version, and the
    trainer reads both turns' versions."""
    from art_trio.cpu.agent_task import (
        LookupTaskConfig,
        lookup_rollout,
    )
    from art_trio.policy.freshness import version_tokens

    backend = in_flight
    seen: list[art.TrajectoryGroup] = []
    trained: list[art.TrajectoryGroup] = []
    # Long enough that a tool call spans most of a training call.
    config = LookupTaskConfig(group_size=4, tool_latency_s=8.0, eval_prompts=1, eval_samples=1)

    async def rollout(
        model: art.TrainableModel, scenario: dict[str, Any], config: LookupTaskConfig
    ) -> art.TrajectoryGroup:
        group = await lookup_rollout(model, scenario, config)
        seen.append(group)
        return group

    def record(groups: list[art.TrajectoryGroup], result: Any) -> None:
        trained.extend(groups)

    step = _train_lookup(
        backend, tmp_path, "agent-in-flight", rollout, config, record,
        seed=1, max_steps_off_policy=3, steps=4,
    )  # fmt: skip
    assert step == 4
    later = 0
    for trajectory in (t for g in seen for t in g.trajectories):
        first, second = (_versions(c) for c in _turns(trajectory))
        for choice, spans in zip(_turns(trajectory), (first, second), strict=True):
            assert sum(n for n, _ in spans) == len(choice.logprobs.content)
        # A turn starts on the newest step: the second never on an older one than the first.
        assert min(v for _, v in second) >= max(v for _, v in first[:1])
        later += int(second[0][1] > first[0][1])
    total = sum(len(g.trajectories) for g in seen)
    print(f"{later} of {total} second turns sampled by a newer policy than their first")
    assert later, "no second turn came after a publish"
    for trajectory in (t for g in trained for t in g.trajectories):
        both = {v for c in _turns(trajectory) for _, v in _versions(c)}
        assert {v for v, _ in version_tokens(trajectory)} == both
