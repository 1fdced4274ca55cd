"""The serving half of art_trio's local backends: an OpenAI-compatible chat-completions app.

Shared by the numpy demo's ``CpuBackend`` (``art_trio.demo``) and the real-model
``CPUBackend`` (``art_trio.cpu``); each supplies only how it answers a validated request.

What you may rely on:

* ``parse_request`` validates a ``POST /v1/chat/completions`` body as OpenAI does: ``model``,
  ``messages``, ``n``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``logprobs``, ``top_logprobs``, ``seed``, vLLM's ``ignore_eos`` (other fields are ignored,
  as vLLM ignores fields it does not know; ``stream`` is refused). A message's ``content``
  is a string or an array of text parts (joined by newlines); anything else is a 400 naming
  the message.
* ``completions_app`` is the app: the route, ``GET /v1/models``, and every error as
  OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 404
  ``model_not_found`` for ``UnknownModelError``, 400 ``invalid_request_error`` for a malformed
  body or bad parameter, 404/405 for unknown routes and methods; a bug answers 500 in the same
  shape instead of dropping the connection. A request whose client disconnects is cancelled
  (the backend's ``answer`` sees the cancellation). With ``api_key``, a missing or wrong
  ``Authorization: Bearer`` header is a 401.
* ``ServedBackend`` runs the app for as long as a backend's ``async with`` block, under trio
  or asyncio (hypercorn's trio or asyncio worker), on a socket bound by ``open_listener``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import anyio
import sniffio
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

logger = logging.getLogger(__name__)

#: OpenAI's own upper bounds for these parameters.
MAX_N = 128
MAX_TOP_LOGPROBS = 20


class UnknownModelError(LookupError):
    """Raised by a registry for a model name it does not serve."""


class OpenAIError(Exception):
    """An error the client should see, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    messages: list[dict[str, Any]]
    n: int
    temperature: float
    top_p: float
    logprobs: bool
    top_logprobs: int
    seed: int | None
    #: ``max_completion_tokens`` if given, else ``max_tokens`` (None: the server's default).
    max_tokens: int | None = None
    #: vLLM's extra field: decode ``max_tokens`` tokens even past a stop token.
    ignore_eos: bool = False


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _default(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _parse_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "you must provide a model parameter")
    return model


def _message_text(i: int, message: dict[str, Any]) -> str | None:
    """A message's content as one string (text parts joined by newlines, as vLLM joins
    them); None only for an assistant message that carries tool calls instead."""
    param = f"messages[{i}].content"
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if message.get("role") == "assistant" and (
            message.get("tool_calls") or message.get("function_call")
        ):
            return None
        raise _bad(param, f"{param} is missing: give a string or an array of text parts.")
    if not isinstance(content, list):
        raise _bad(
            param,
            f"{param} must be a string or an array of text parts, not {type(content).__name__}.",
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(
                f"{param}[{j}]",
                f"{param}[{j}] is {kind!r}: this server reads only text parts "
                '({"type": "text", "text": "..."}).',
            )
        if not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", f"{param}[{j}] must have a string 'text'.")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages, each a copy whose ``content`` is a string (content parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty array of message objects.")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a 'role'.")
        parsed.append({**message, "content": _message_text(i, message)})
    return parsed


def _parse_n(body: dict[str, Any]) -> int:
    n = _default(body, "n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _bad("n", f"{n!r} is not a valid value for 'n': it must be between 1 and {MAX_N}.")
    return int(n)


def _check_token_limits(body: dict[str, Any]) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise _bad(key, f"{value!r} is not a valid value for '{key}': it must be >= 1.")


def _max_tokens(body: dict[str, Any]) -> int | None:
    # _check_token_limits has checked both are None or integers >= 1.
    value = body.get("max_completion_tokens")
    return value if value is not None else body.get("max_tokens")


def _parse_sampling(body: dict[str, Any]) -> tuple[float, float]:
    """``(temperature, top_p)``."""
    temperature = _default(body, "temperature", 1.0)
    if not _is_number(temperature) or not 0.0 <= float(temperature) <= 2.0:
        raise _bad("temperature", f"{temperature!r} is not between 0 and 2 - 'temperature'.")
    top_p = _default(body, "top_p", 1.0)
    if not _is_number(top_p) or not 0.0 < float(top_p) <= 1.0:
        raise _bad("top_p", f"{top_p!r} is not in (0, 1] - 'top_p'.")
    return float(temperature), float(top_p)


def _parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """``(logprobs, top_logprobs)``."""
    logprobs = _default(body, "logprobs", False)
    if not isinstance(logprobs, bool):
        raise _bad("logprobs", f"{logprobs!r} is not a boolean - 'logprobs'.")
    top_logprobs = _default(body, "top_logprobs", 0)
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}.")
    if top_logprobs and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    return logprobs, int(top_logprobs)


def _parse_seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("seed", f"{seed!r} is not an integer - 'seed'.")
    return seed


def parse_request(body: object) -> CompletionRequest:
    """Validate a decoded JSON body as OpenAI does, raising ``OpenAIError`` (400).

    Fields are checked in a fixed order (model, messages, n, token limits, temperature, top_p,
    logprobs, top_logprobs, seed, stream); the first bad one is reported.
    """
    if not isinstance(body, dict):
        raise _bad("body", "The request body must be a JSON object.")
    model = _parse_model(body)
    messages = _parse_messages(body)
    n = _parse_n(body)
    _check_token_limits(body)
    temperature, top_p = _parse_sampling(body)
    logprobs, top_logprobs = _parse_logprobs(body)
    seed = _parse_seed(body)
    ignore_eos = _default(body, "ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", f"{ignore_eos!r} is not a boolean - 'ignore_eos'.")
    if body.get("stream"):
        raise _bad("stream", "This server does not stream; send 'stream': false.")
    return CompletionRequest(
        model=model,
        messages=messages,
        n=n,
        temperature=temperature,
        top_p=top_p,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        seed=seed,
        max_tokens=_max_tokens(body),
        ignore_eos=ignore_eos,
    )


#: How a backend answers a validated request: the ``ChatCompletion`` JSON, given the request
#: and its raw body (for vLLM's extra fields). Raises ``UnknownModelError`` or ``OpenAIError``.
Answer = Callable[[CompletionRequest, dict[str, Any]], Awaitable[dict[str, Any]]]


def _unauthorized() -> Response:
    return OpenAIError(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key this "
        "server was started with (the backend's api_key).",
        code="invalid_api_key",
    ).response()


async def _answer_while_connected(
    http_request: Request, answer: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any] | None:
    """``await answer()``, cancelled if the client disconnects first (then None).

    The body has been read, so the next ASGI message is the disconnect: a client that goes
    away (a cancelled rollout) stops the work done for it, as vLLM aborts its request."""
    result: dict[str, Any] | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await http_request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await answer()
        except Exception as exc:  # raised as itself below, not inside an exception group
            error = exc
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


def completions_app(
    answer: Answer,
    model_names: Callable[[], list[str]],
    *,
    owned_by: str,
    api_key: str | None = None,
) -> Starlette:
    """The ASGI app: ``POST /v1/chat/completions`` validated, then ``answer``-ed; ``GET
    /v1/models`` lists ``model_names()``; errors in OpenAI's shape (module docstring). With
    ``api_key``, both routes answer 401 unless the request sends ``Authorization: Bearer
    <api_key>``."""
    expected = api_key.encode() if api_key is not None else None

    def authorized(http_request: Request) -> bool:
        if expected is None:
            return True
        scheme, _, token = http_request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), expected
        )

    async def chat_completions(http_request: Request) -> Response:
        if not authorized(http_request):
            return _unauthorized()
        try:
            raw = await http_request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise OpenAIError(
                    400,
                    f"We could not parse the JSON body of your request. ({exc})",
                ) from None
            request = parse_request(body)
            try:
                result = await _answer_while_connected(http_request, lambda: answer(request, body))
            except UnknownModelError:
                raise OpenAIError(
                    404,
                    f"The model `{request.model}` does not exist.",
                    param="model",
                    code="model_not_found",
                ) from None
            if result is None:  # the client went away; nobody reads an answer
                return Response(status_code=499)
            return JSONResponse(result)
        except OpenAIError as exc:
            return exc.response()
        except ClientDisconnect:
            # The client gave up (a rollout cancelled at shutdown): nobody reads this answer.
            return Response(status_code=499)
        except Exception:
            # A bug here must still answer, so one bad request cannot take a rollout down.
            logger.exception("chat completion failed")
            return OpenAIError(500, "Internal server error.", type="server_error").response()

    async def list_models(http_request: Request) -> Response:
        if not authorized(http_request):
            return _unauthorized()
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by}
            for name in model_names()
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


def open_listener(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one; read it back with
    ``getsockname()``). Raises ``OSError`` at once if the address is taken.

    Bound here rather than by hypercorn, so the port is known before serving on both loops
    (hypercorn's asyncio worker cannot report it), and a connection that arrives before
    hypercorn accepts waits in the kernel's backlog instead of being refused.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
    except BaseException:
        listener.close()
        raise
    return listener


async def serve(
    app: Starlette,
    listener: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    graceful_timeout: float = 1.0,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``listener`` until ``shutdown_trigger`` returns.

    Takes ownership of ``listener``: it is closed, and the port released, when this returns.
    Runs hypercorn's trio worker under trio and its asyncio worker under asyncio.
    """
    library = sniffio.current_async_library()
    try:
        config = Config()
        # hypercorn owns (and closes) the duplicate; we close the original below.
        config.bind = [f"fd://{os.dup(listener.fileno())}"]
        config.accesslog = None
        config.errorlog = logger
        config.graceful_timeout = graceful_timeout
        # The worker is imported before reporting started, so a missing one fails the start.
        if library == "trio":
            import hypercorn.trio as worker
        else:
            import hypercorn.asyncio as worker  # type: ignore[no-redef]
        task_status.started()
        # Starlette is an ASGI app; hypercorn's ASGI type is narrower than starlette's.
        asgi_app: Any = app
        await worker.serve(asgi_app, config, shutdown_trigger=shutdown_trigger)
    finally:
        listener.close()


class ServedBackend:
    """The serving half of a local ART backend: its OpenAI-compatible app on ``host``, up for
    as long as the backend's ``async with`` block runs (under trio or asyncio).

    Subclasses call ``_init_serving`` in ``__init__``, return their app from ``_make_app``,
    and may load what serving needs in ``_before_serving`` (before the port is bound).
    """

    host: str

    def _init_serving(self, host: str, port: int) -> None:
        self.host = host
        self._requested_port = port
        self._port: int | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._shutdown: anyio.Event | None = None

    async def _before_serving(self) -> None:
        """Load what serving needs (nothing by default)."""

    def _make_app(self) -> Starlette:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        if self._task_group is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
        await self._before_serving()
        # Bind first, outside the task group: a taken port is a plain OSError here.
        listener = open_listener(self.host, self._requested_port)
        # Read now: once serving, the listener belongs to serve(), which closes it on its way out.
        port = int(listener.getsockname()[1])
        self._shutdown = anyio.Event()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self._serve, self._make_app(), listener)
        except BaseException as exc:
            listener.close()  # serve() closes it too; closing twice is harmless
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._port = port
        self._task_group = task_group
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None and self._shutdown is not None
        self._shutdown.set()
        try:
            if isinstance(exc, Exception):
                # The body's own error (a misspelt trainer keyword, a failed run) reaches the
                # caller as itself, not inside the server's task group's ExceptionGroup: the
                # server shuts down, then the error goes on. Cancellation and KeyboardInterrupt
                # still go through the group, which must see them.
                await self._task_group.__aexit__(None, None, None)
                return None
            return await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._task_group = None
            self._port = None

    async def _serve(
        self,
        app: Starlette,
        listener: socket.socket,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        assert self._shutdown is not None
        await serve(app, listener, shutdown_trigger=self._shutdown.wait, task_status=task_status)

    async def close(self) -> None:
        """Ask the server to stop; it is gone once the ``async with`` block exits.

        Safe to call from asyncio code running under trio-asyncio: setting the event is a
        synchronous call on the loop's own thread.
        """
        if self._shutdown is not None:
            self._shutdown.set()

    @property
    def port(self) -> int:
        """The server's bound port (only while the context is entered)."""
        if self._port is None:
            name = type(self).__name__
            raise RuntimeError(f"{name} is not running: use `async with {name}(...)`")
        return self._port

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, the OpenAI base URL of the running server."""
        return f"http://{self.host}:{self.port}/v1"
