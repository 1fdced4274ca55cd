"""The numpy policy's answers for the local backends' OpenAI-compatible server.

``art_trio.local_backend.server`` is the server (validation, errors, listener, serving);
this module answers a validated request from the numpy policy. What you may rely on:

* ``POST /v1/chat/completions`` answers with OpenAI ``ChatCompletion`` JSON: ``n`` choices of one
  token each, ``choices[i].logprobs.content[0]`` (``token``, ``logprob``, ``bytes``,
  ``top_logprobs``) when ``logprobs`` is true, and ``usage``. It honours ``model`` (``name@step``
  or ``name`` for the latest step), ``n``, ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``logprobs``, ``top_logprobs`` and ``seed``.
* ``GET /v1/models`` lists every ``name@step`` the registry holds; errors are OpenAI's shape
  (see ``art_trio.local_backend.server``).
"""

from __future__ import annotations

import secrets
import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
from starlette.applications import Starlette

from ..local_backend.server import (
    CompletionRequest,
    completions_app,
)
from .policy import VOCAB, FloatArray, log_probs, prompt_features, sample

__all__ = ["PolicyRegistry", "complete", "create_app"]


class PolicyRegistry(Protocol):
    """Where the server finds weights. ``CpuBackend`` is one."""

    def checkout(self, model: str) -> AbstractContextManager[FloatArray]:
        """Weights for ``model`` (``name@step`` or ``name``), held for the ``with`` block so
        they cannot be evicted mid-request. Raises ``UnknownModelError``."""
        ...

    def model_names(self) -> list[str]:
        """Every ``name@step`` currently servable."""
        ...


def _token_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def complete(
    request: CompletionRequest, weights: FloatArray, rng: np.random.Generator
) -> dict[str, Any]:
    """The ``ChatCompletion`` JSON for a validated request, sampled from ``weights``."""
    features = prompt_features(request.messages)
    logp = log_probs(weights, features)
    tokens = sample(
        weights, features, request.n, rng, temperature=request.temperature, top_p=request.top_p
    )
    top = [
        int(i) for i in np.argsort(-logp, kind="stable")[: min(request.top_logprobs, len(VOCAB))]
    ]
    choices = []
    for index, token in enumerate(tokens):
        word = VOCAB[token]
        choice_logprobs = None
        if request.logprobs:
            # Raw (temperature-1) logprobs, like vLLM's default: the policy that trains.
            entry = _token_logprob(word, float(logp[token]))
            entry["top_logprobs"] = [_token_logprob(VOCAB[i], float(logp[i])) for i in top]
            choice_logprobs = {"content": [entry], "refusal": None}
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": word, "refusal": None},
                "logprobs": choice_logprobs,
                "finish_reason": "stop",
            }
        )
    prompt_tokens = int(np.count_nonzero(features)) - 1
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": request.n,
            "total_tokens": prompt_tokens + request.n,
        },
    }


def create_app(registry: PolicyRegistry, *, seed: int = 0) -> Starlette:
    """The ASGI app. Requests without a ``seed`` draw from one generator seeded with ``seed``;
    a request with one gets its own stream, so it repeats exactly for the same weights."""
    shared_rng = np.random.default_rng(seed)

    def rng_for(request: CompletionRequest) -> np.random.Generator:
        if request.seed is None:
            return shared_rng
        # The seed alone picks the random stream, not the model name: two steps asked with one
        # seed see the same draws through different probabilities (common random numbers), and
        # runs under different model names repeat each other.
        return np.random.default_rng(request.seed % 2**63)

    async def answer(request: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        with registry.checkout(request.model) as weights:
            return complete(request, weights, rng_for(request))

    return completions_app(answer, registry.model_names, owned_by="art-trio-demo")
