"""The OpenAI-compatible chat-completions app of the CPU backend (starlette, hypercorn).

Request validation, error shapes, ``GET /v1/models`` and serving are the local backends'
(``art_trio.local_backend.server``); this module only answers with a real language model.

What you may rely on:

* ``POST /v1/chat/completions``: ``model`` is ``name@step`` (or ``name``: the newest step);
  ``n``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``logprobs`` and ``top_logprobs`` are honoured. Answers are vLLM's as ART configures it:
  ``choices[].logprobs.content[]`` with ``token`` (``"token_id:N"``, vLLM's
  ``return_tokens_as_token_ids``; send ``"return_tokens_as_token_ids": false`` for token text),
  ``logprob`` (raw, temperature 1), ``bytes`` and ``top_logprobs``; ``prompt_token_ids`` and
  ``choices[].token_ids`` (vLLM's ``return_token_ids``), and ``usage``.
* ``ignore_eos`` (vLLM's extra field): decode ``max_tokens`` tokens whatever is sampled.
* Requests are decoded together, continuously batched (``art_trio.cpu.engine``); a request
  whose client goes away is aborted before the next decode step. ``max_tokens`` past the
  model's context or the backend's ``max_tokens_limit`` is refused with a 400.
* With in-flight updates on (``CPUBackend(in_flight_updates=True)``), each choice carries ART
  0.5.20+'s ``policy_token_spans``: half-open ``[start_token, end_token)`` runs of its
  completion tokens, each with the ``policy_version`` (step) that produced them,
  ``generation_id`` (``name@step``), ``lora_slot`` (the model asked for) and ``update_seq``
  (the step again: one update a step); and ``prompt_policy_token_spans``, the prompt's
  tokens from 1 (those with a causal logprob), under the step that prefilled it. ART's
  clients read both from the choice on every line (0.5.17-0.5.18 keep them in the choice's
  ``model_extra``, where ``art_trio.policy.freshness`` reads them).
* With an API key set, requests without ``Authorization: Bearer <key>`` get a 401.
* ``GET /v1/models`` lists every servable ``name@step``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Protocol

from starlette.applications import Starlette

from ..local_backend.server import CompletionRequest, completions_app
from .sampling import Completion


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
        ignore_eos: bool = False,
    ) -> tuple[list[int], list[Completion]]:
        """``(prompt_token_ids, completions)``; raises ``UnknownModelError`` or
        ``OpenAIError``. Cancelling the call aborts the request."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def model_names(self) -> list[str]: ...

    @property
    def reports_policy_spans(self) -> bool:
        """Whether answers carry ``policy_token_spans``."""
        ...


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
    policy_spans: bool = False,
) -> dict[str, Any]:
    """The ``ChatCompletion`` body for sampled completions (with ``policy_spans``, each
    choice's ``policy_token_spans`` and ``prompt_policy_token_spans``)."""
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
        choice: dict[str, Any] = {
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
        if policy_spans:
            choice.update(_policy_spans(model, len(prompt_ids), completion))
        choices.append(choice)
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


def _span(slot: str, start: int, end: int, version: int) -> dict[str, Any]:
    name = slot.rpartition("@")[0] or slot.removesuffix(":active")
    return {
        "start_token": start,
        "end_token": end,
        "generation_id": f"{name}@{version}",
        "policy_version": version,
        "lora_slot": slot,
        "update_seq": version,
    }


def _policy_spans(slot: str, prompt_tokens: int, completion: Completion) -> dict[str, Any]:
    spans, start = [], 0
    for version, tokens in completion.policy_runs:
        spans.append(_span(slot, start, start + tokens, version))
        start += tokens
    prefill = completion.policy_runs[0][0] if completion.policy_runs else 0
    prompt = [_span(slot, 1, prompt_tokens, prefill)] if prompt_tokens > 1 else []
    return {"policy_token_spans": spans, "prompt_policy_token_spans": prompt}


def create_app(sampler: Sampler, *, api_key: str | None = None) -> Starlette:
    """The app; with ``api_key``, every request must send ``Authorization: Bearer <key>``."""

    async def answer(request: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        prompt_ids, completions = await sampler.sample(
            request.model,
            request.messages,
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_logprobs=request.top_logprobs if request.logprobs else 0,
            seed=request.seed,
            ignore_eos=request.ignore_eos,
        )
        return completion_json(
            sampler,
            model=request.model,
            prompt_ids=prompt_ids,
            completions=completions,
            logprobs=request.logprobs,
            as_token_ids=body.get("return_tokens_as_token_ids", True) is not False,
            policy_spans=sampler.reports_policy_spans,
        )

    return completions_app(answer, sampler.model_names, owned_by="art-trio-cpu", api_key=api_key)
