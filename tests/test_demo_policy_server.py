"""The CPU demo's OpenAI-compatible server, reached by real OpenAI clients on trio, on asyncio
and on asyncio-under-trio (trio-asyncio)."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import trio  # noqa: E402
import trio_asyncio  # noqa: E402
from openai.types.chat import ChatCompletionMessageParam  # noqa: E402

from art_trio.demo.backend import CpuBackend  # noqa: E402
from art_trio.demo.policy import VOCAB  # noqa: E402
from art_trio.plumbing.compat import trainable_model
from tests.loops import require_trio_asyncio_patched_anyio

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "respond with yes, no, maybe"}
]


def make_model(tmp_path: Path, name: str = "demo") -> art.TrainableModel:
    return trainable_model(
        name=name, project="server-tests", base_model="cpu-demo", base_path=str(tmp_path)
    )


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[CpuBackend, art.TrainableModel]]:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        yield backend, model


def client_for(backend: CpuBackend) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=backend.base_url, api_key=backend.api_key, max_retries=0)


async def test_chat_completion_with_n_and_logprobs(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, model = served
    async with client_for(backend) as client:
        response = await client.chat.completions.create(
            model=model.get_inference_name(0),
            messages=MESSAGES,
            n=5,
            max_tokens=5,
            logprobs=True,
            top_logprobs=3,
        )
    assert response.object == "chat.completion"
    assert response.model == "demo@0"
    assert [c.index for c in response.choices] == [0, 1, 2, 3, 4]
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.role == "assistant"
        assert choice.message.content in VOCAB
        assert choice.logprobs is not None and choice.logprobs.content is not None
        [token] = choice.logprobs.content
        assert token.token == choice.message.content
        assert token.bytes == list(token.token.encode())
        assert token.logprob < 0.0
        top = token.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # The reported logprobs are one distribution: the top-3 hold at most all the mass.
        assert sum(math.exp(t.logprob) for t in top) <= 1.0 + 1e-9
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5


async def test_without_logprobs_choices_have_none(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, model = served
    async with client_for(backend) as client:
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=MESSAGES,
        )
    [choice] = response.choices
    assert choice.logprobs is None


async def test_seed_repeats_and_temperature_zero_is_greedy(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, model = served
    async with client_for(backend) as client:

        async def answers(**kwargs: Any) -> list[str | None]:
            response = await client.chat.completions.create(
                model=model.get_inference_name(0),
                messages=MESSAGES,
                n=16,
                **kwargs,
            )
            return [c.message.content for c in response.choices]

        assert await answers(seed=123) == await answers(seed=123)
        greedy = await answers(temperature=0)
        assert len(set(greedy)) == 1


async def test_models_endpoint_lists_served_steps(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, _ = served
    async with client_for(backend) as client:
        page = await client.models.list()
    assert [m.id for m in page.data] == ["demo@0"]


async def test_model_openai_client_reaches_server_natively_under_trio(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, model = served
    assert model.inference_base_url == backend.base_url
    assert model.inference_base_url.endswith("/v1")
    assert model.inference_model_name == "demo@0"
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=MESSAGES,
        n=2,
    )
    assert len(response.choices) == 2
    await model.openai_client().close()


async def test_asyncio_code_under_trio_asyncio_reaches_server(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    _, model = served
    require_trio_asyncio_patched_anyio()

    async def asyncio_rollout() -> list[str | None]:
        # Plain asyncio code, as a GPU user's rollout would be.
        assert asyncio.get_running_loop() is not None
        client = model.openai_client()
        try:
            response = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=MESSAGES,
                n=3,
                logprobs=True,
            )
            return [c.message.content for c in response.choices]
        finally:
            await client.close()

    async with trio_asyncio.open_loop():
        answers = await trio_asyncio.aio_as_trio(asyncio_rollout)()
    assert len(answers) == 3 and all(a in VOCAB for a in answers)


def test_backend_serves_and_shuts_down_under_asyncio(tmp_path: Path) -> None:
    async def main() -> int:
        async with CpuBackend(seed=1) as backend:
            model = make_model(tmp_path)
            await model.register(backend)
            client = model.openai_client()
            response = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=MESSAGES,
                n=4,
                logprobs=True,
            )
            assert len(response.choices) == 4
            await client.close()
            port = backend.port
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        return port

    assert asyncio.run(main()) > 0


async def test_unknown_model_is_openai_404(served: tuple[CpuBackend, art.TrainableModel]) -> None:
    backend, _ = served
    async with client_for(backend) as client:
        for name in ("nope@0", "demo@7", "demo@x", "nope"):
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(
                    model=name,
                    messages=MESSAGES,
                )
            assert info.value.status_code == 404
            assert info.value.code == "model_not_found"
            assert info.value.type == "invalid_request_error"
            assert info.value.param == "model"
            assert name in info.value.message


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": -2}, "n"),
        ({"n": 1000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"seed": 1.5}, "seed"),
    ],
)
async def test_bad_parameters_are_openai_400(
    served: tuple[CpuBackend, art.TrainableModel], params: dict[str, Any], param: str
) -> None:
    backend, model = served
    async with client_for(backend) as client:
        # Untyped on purpose: these are the invalid values the SDK's types would reject.
        create: Any = client.chat.completions.create
        with pytest.raises(openai.BadRequestError) as info:
            await create(
                model=model.get_inference_name(),
                messages=MESSAGES,
                **params,
            )
    assert info.value.status_code == 400
    assert info.value.type == "invalid_request_error"
    assert info.value.param == param


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"model": "demo@0"}',
        b'{"model": "demo@0", "messages": []}',
        b'{"model": "demo@0", "messages": ["hi"]}',
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "demo@0", "messages": [{"role": "user", "content": "x"}], "stream": true}',
        b'{"model": "demo@0", "messages": [{"role": "user", "content": "x"}], "n": "3"}',
    ],
)
async def test_malformed_bodies_are_openai_400(
    served: tuple[CpuBackend, art.TrainableModel], content: bytes
) -> None:
    backend, _ = served
    async with httpx.AsyncClient(base_url=backend.base_url) as http:
        response = await http.post(
            "/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["message"]
        # The server is still fine afterwards.
        ok = await http.post("/chat/completions", json={"model": "demo@0", "messages": MESSAGES})
        assert ok.status_code == 200


async def test_unknown_route_and_method_are_openai_errors(
    served: tuple[CpuBackend, art.TrainableModel],
) -> None:
    backend, _ = served
    async with httpx.AsyncClient(base_url=backend.base_url) as http:
        missing = await http.post("/completions", json={})
        assert missing.status_code == 404
        assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
        wrong_method = await http.get("/chat/completions")
        assert wrong_method.status_code == 405
        assert "error" in wrong_method.json()


async def test_server_port_is_closed_when_backend_context_exits(tmp_path: Path) -> None:
    async with CpuBackend(seed=0) as backend:
        model = make_model(tmp_path)
        await model.register(backend)
        port = backend.port
        # Connected and used: a keep-alive connection is open when the context exits.
        http = httpx.AsyncClient(base_url=backend.base_url)
        assert (await http.get("/models")).status_code == 200
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    with pytest.raises(httpx.TransportError):
        await http.get("/models")
    await http.aclose()
    with pytest.raises(RuntimeError):
        _ = backend.base_url


async def test_taken_port_is_a_plain_oserror() -> None:
    async with CpuBackend(seed=0) as running:
        with pytest.raises(OSError):
            async with CpuBackend(port=running.port):
                pytest.fail("a second server bound the same port")
        # The first server is unaffected.
        async with client_for(running) as client:
            await client.models.list()


async def test_close_stops_the_server(tmp_path: Path) -> None:
    """ART's ``backend.close()`` (an asyncio-side call) ends the serving task, so the
    ``async with`` block's exit does not have to wait for anything else."""
    async with CpuBackend(seed=0) as backend:
        port = backend.port
        await trio_asyncio_close(backend)
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def trio_asyncio_close(backend: CpuBackend) -> None:
    async with trio_asyncio.open_loop():
        await trio_asyncio.aio_as_trio(backend.close)()
