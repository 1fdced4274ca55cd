"""The OpenAI-compatible chat-completions app of the CPU backend (starlette, hypercorn).

Request validation, error shapes, the listener and ``serve`` are the numpy demo's
(``art_trio.demo.server``); this module only answers with a real language model.

What you may rely on:

* ``POST /v1/chat/completions``: ``model`` is ``name@step`` (or ``name``: the newest step);
  ``n``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``logprobs`` and ``top_logprobs`` are honoured. Answers are vLLM's as ART configures it:
  ``choices[].logprobs.content[]`` with ``token`` (``"token_id:N"``, vLLM's
  ``return_tokens_as_token_ids``; send ``"return_tokens_as_token_ids": false`` for token text),
  ``logprob`` (raw, temperature 1), ``bytes`` and ``top_logprobs``; ``prompt_token_ids`` and
  ``choices[].token_ids`` (vLLM's ``return_token_ids``), and ``usage``.
* Generation runs in a worker thread: the event loop keeps serving while a request samples.
* ``GET /v1/models`` lists every servable ``name@step``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..demo.server import MAX_TOP_LOGPROBS, OpenAIError, UnknownModelError, parse_request
from .sampling import Completion

logger = logging.getLogger(__name__)


class Sampler(Protocol):
    """What the app needs from the backend."""

    async def sample(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        n: int,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        top_logprobs: int,
        seed: int | None,
    ) -> tuple[list[int], list[Completion]]:
        """``(prompt_token_ids, completions)``; raises ``UnknownModelError``."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def model_names(self) -> list[str]: ...


def _entry(sampler: Sampler, token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    text = sampler.decode([token])
    return {
        "token": f"token_id:{token}" if as_ids else text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
    }


def completion_json(
    sampler: Sampler,
    *,
    model: str,
    prompt_ids: list[int],
    completions: list[Completion],
    logprobs: bool,
    as_token_ids: bool,
) -> dict[str, Any]:
    """The ``ChatCompletion`` body for sampled completions."""
    choices = []
    for index, completion in enumerate(completions):
        ids = completion.token_ids
        text_ids = ids[:-1] if completion.finish_reason == "stop" else ids
        choice_logprobs = None
        if logprobs:
            content = []
            for position, (token, value) in enumerate(zip(ids, completion.logprobs, strict=True)):
                entry = _entry(sampler, token, value, as_token_ids)
                entry["top_logprobs"] = [
                    _entry(sampler, t, v, as_token_ids)
                    for t, v in (completion.top[position] if completion.top else [])
                ]
                content.append(entry)
            choice_logprobs = {"content": content, "refusal": None}
        choices.append(
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": sampler.decode(text_ids),
                    "refusal": None,
                },
                "logprobs": choice_logprobs,
                "finish_reason": completion.finish_reason,
                "token_ids": ids,
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }


def _max_tokens(body: dict[str, Any]) -> int | None:
    # parse_request has checked both are None or integers >= 1.
    value = body.get("max_completion_tokens")
    return value if value is not None else body.get("max_tokens")


def create_app(sampler: Sampler) -> Starlette:
    async def chat_completions(http_request: Request) -> Response:
        try:
            raw = await http_request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise OpenAIError(
                    400, f"We could not parse the JSON body of your request. ({exc})"
                ) from None
            request = parse_request(body)
            top_logprobs = int(body.get("top_logprobs") or 0)
            if top_logprobs > MAX_TOP_LOGPROBS:  # parse_request has refused it already
                raise OpenAIError(400, "'top_logprobs' is too large.", param="top_logprobs")
            as_ids = body.get("return_tokens_as_token_ids", True) is not False
            try:
                prompt_ids, completions = await sampler.sample(
                    request.model,
                    request.messages,
                    n=request.n,
                    max_tokens=_max_tokens(body),
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_logprobs=top_logprobs if request.logprobs else 0,
                    seed=request.seed,
                )
            except UnknownModelError:
                raise OpenAIError(
                    404,
                    f"The model `{request.model}` does not exist.",
                    param="model",
                    code="model_not_found",
                ) from None
            return JSONResponse(
                completion_json(
                    sampler,
                    model=request.model,
                    prompt_ids=prompt_ids,
                    completions=completions,
                    logprobs=request.logprobs,
                    as_token_ids=as_ids,
                )
            )
        except OpenAIError as exc:
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("chat completion failed")
            return OpenAIError(500, "Internal server error.", type="server_error").response()

    async def list_models(_: Request) -> Response:
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "art-trio-cpu"}
            for name in sampler.model_names()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: http_error
    }
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
        ],
        exception_handlers=handlers,
    )
