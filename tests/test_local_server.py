"""The local backends' shared chat-completions app (``art_trio.local_backend.server``) over real
HTTP: content-part messages, malformed messages, the optional API key, and a client that goes
away cancelling the work done for it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import trio  # noqa: E402

from art_trio.local_backend.server import (  # noqa: E402
    CompletionRequest,
    completions_app,
    open_listener,
    serve,
)

Answer = Callable[[CompletionRequest, dict[str, Any]], Awaitable[dict[str, Any]]]


def _echo_body(request: CompletionRequest) -> dict[str, Any]:
    """A ChatCompletion whose answer is the last message's content, as the app passed it."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": request.messages[-1]["content"]},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
    }


async def _echo(request: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
    return _echo_body(request)


@asynccontextmanager
async def _served(answer: Answer, *, api_key: str | None = None) -> AsyncIterator[str]:
    """The app on 127.0.0.1 for the block; yields its base URL."""
    app = completions_app(answer, lambda: ["m@0"], owned_by="test", api_key=api_key)
    listener = open_listener()
    port = listener.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve(
                app, listener, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop.set()


async def test_content_parts_are_joined_text() -> None:
    async with _served(_echo) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            response = await client.chat.completions.create(
                model="m@0",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "respond with"},
                            {"type": "text", "text": "yes, no, maybe"},
                        ],
                    }
                ],
            )
    assert response.choices[0].message.content == "respond with\nyes, no, maybe"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user", "content": 123}, "messages[0].content"),
        ({"role": "user", "content": {"type": "text", "text": "x"}}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0]"),
        ({"role": "user", "content": ["hi"]}, "messages[0].content[0]"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0]",
        ),
    ],
)
async def test_malformed_messages_are_400_naming_the_message(
    message: dict[str, Any], param: str
) -> None:
    async with _served(_echo) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post(
            "/chat/completions", json={"model": "m@0", "messages": [message]}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert param in error["message"]


async def test_an_assistant_message_with_tool_calls_needs_no_content() -> None:
    messages = [
        {"role": "user", "content": "call it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    async with _served(_echo) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/chat/completions", json={"model": "m@0", "messages": messages})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "done"


async def test_api_key_is_required_when_set() -> None:
    async with _served(_echo, api_key="sesame") as url:
        for key in ("wrong", "sesame-not"):
            async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError) as info:
                    await client.chat.completions.create(
                        model="m@0", messages=[{"role": "user", "content": "x"}]
                    )
                assert info.value.status_code == 401
                assert info.value.code == "invalid_api_key"
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
        async with httpx.AsyncClient(base_url=url) as http:  # no header at all
            response = await http.get("/models")
            assert response.status_code == 401
        async with openai.AsyncOpenAI(base_url=url, api_key="sesame", max_retries=0) as client:
            response = await client.chat.completions.create(
                model="m@0", messages=[{"role": "user", "content": "x"}]
            )
            assert response.choices[0].message.content == "x"
            assert [m.id async for m in client.models.list()] == ["m@0"]


async def test_without_a_key_any_key_is_accepted() -> None:
    async with _served(_echo) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="anything", max_retries=0) as client:
            response = await client.chat.completions.create(
                model="m@0", messages=[{"role": "user", "content": "x"}]
            )
    assert response.choices[0].message.content == "x"


async def test_ignore_eos_must_be_a_boolean() -> None:
    async with _served(_echo) as url, httpx.AsyncClient(base_url=url) as http:
        body = {"model": "m@0", "messages": [{"role": "user", "content": "x"}]}
        response = await http.post("/chat/completions", json={**body, "ignore_eos": "yes"})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "ignore_eos"


async def test_a_client_that_goes_away_cancels_the_answer() -> None:
    """The real openai client, cancelled mid-request: the app cancels the backend's answer
    (where the CPU backend aborts the request's decoding)."""
    started, cancelled = trio.Event(), trio.Event()

    async def never(request: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    async with _served(never) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:

                    async def ask() -> None:
                        await client.chat.completions.create(
                            model="m@0", messages=[{"role": "user", "content": "x"}]
                        )

                    nursery.start_soon(ask)
                    await started.wait()
                    nursery.cancel_scope.cancel()  # the rollout is cancelled
                await cancelled.wait()
            assert not scope.cancelled_caught, "the answer went on after the client left"


def test_a_client_that_goes_away_cancels_the_answer_under_asyncio() -> None:
    """The same on hypercorn's asyncio worker, with the client's asyncio task cancelled."""
    import asyncio

    async def main() -> None:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def never(request: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
            raise AssertionError("unreachable")

        app = completions_app(never, lambda: ["m@0"], owned_by="test")
        listener = open_listener()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve(app, listener, shutdown_trigger=stop.wait))
        try:
            async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
                ask = asyncio.ensure_future(
                    client.chat.completions.create(
                        model="m@0", messages=[{"role": "user", "content": "x"}]
                    )
                )
                await asyncio.wait_for(started.wait(), 30)
                ask.cancel()  # the rollout is cancelled
                await asyncio.wait_for(cancelled.wait(), 30)  # TimeoutError: it went on
        finally:
            stop.set()
            await server

    # A plain loop: this suite's loop policy is trio-asyncio's (see tests/test_cpu_llm.py).
    loop = asyncio.SelectorEventLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


# -- completion-token settings (issue 51, item 6) -------------------------------------------


def test_a_default_above_the_limit_is_refused_saying_what_to_pass() -> None:
    from art_trio.local_backend.limits import completion_token_default

    with pytest.raises(ValueError) as refused:
        completion_token_default(200, 16, fallback=64)
    message = str(refused.value)
    assert "default_max_tokens=200 is above max_tokens_limit=16" in message
    assert "default_max_tokens <= 16" in message and "max_tokens_limit >= 200" in message
    with pytest.raises(ValueError, match="default_max_tokens must be >= 1"):
        completion_token_default(0, None, fallback=64)
    with pytest.raises(ValueError, match="max_tokens_limit must be >= 1"):
        completion_token_default(16, 0, fallback=64)
    assert completion_token_default(16, 16, fallback=64) == 16
    assert completion_token_default(200, None, fallback=64) == 200
    # Not given: the backend's own default, held to the limit (no error for a limit alone).
    assert completion_token_default(None, 16, fallback=64) == 16
    assert completion_token_default(None, None, fallback=64) == 64


def test_a_request_without_max_tokens_is_held_to_the_limit_and_the_context() -> None:
    from art_trio.local_backend.limits import default_completion_tokens

    assert default_completion_tokens(200, 16, room=1000) == 16
    assert default_completion_tokens(200, None, room=1000) == 200
    assert default_completion_tokens(200, 16, room=10) == 10
