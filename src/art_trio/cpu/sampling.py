"""Sampling completions with per-token logprobs from a causal LM, on the CPU.

``generate`` is synchronous and CPU-bound: the server calls it in a worker thread. Logprobs
are the model's raw (temperature 1) log-softmax of the token sampled, like vLLM's default:
that is the policy ``train`` computes its importance ratio against, whatever temperature
sampled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (the stop token included, as vLLM returns it),
    each token's raw logprob, and the top alternatives at each position."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens)


def _filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@torch.inference_mode()
def generate(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_logprobs: int,
    stop_ids: set[int],
    generator: torch.Generator,
) -> list[Completion]:
    """``n`` completions of ``prompt_ids``, decoded together with a KV cache."""
    input_ids = torch.tensor([list(prompt_ids)] * n, dtype=torch.long)
    output = model(input_ids=input_ids, use_cache=True)
    past = output.past_key_values
    logits = output.logits[:, -1, :]
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
    finished = [False] * n
    for _ in range(max_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if temperature == 0.0:
            chosen = torch.argmax(logp, dim=-1)
        else:
            probs = _filter_top_p(torch.softmax(logits.float() / temperature, dim=-1), top_p)
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if top_logprobs:
            top_values, top_ids = torch.topk(logp, top_logprobs, dim=-1)
        for i in range(n):
            if finished[i]:
                continue
            token = int(chosen[i])
            tokens[i].append(token)
            logprobs[i].append(float(logp[i, token]))
            if top_logprobs:
                tops[i].append(
                    [(int(t), float(v)) for t, v in zip(top_ids[i], top_values[i], strict=True)]
                )
            if token in stop_ids:
                finished[i] = True
        if all(finished):
            break
        # Finished rows keep decoding (their tokens are dropped): one batch, no re-padding.
        output = model(input_ids=chosen.unsqueeze(-1), past_key_values=past, use_cache=True)
        past = output.past_key_values
        logits = output.logits[:, -1, :]
    return [
        Completion(
            token_ids=tokens[i],
            logprobs=logprobs[i],
            top=tops[i],
            finish_reason="stop" if finished[i] else "length",
        )
        for i in range(n)
    ]


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template applied to ``messages`` with the assistant's generation prompt."""
    output = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(output, list):  # a BatchEncoding on newer transformers
        output = output["input_ids"]
    if output and isinstance(output[0], list):
        output = output[0]
    return [int(t) for t in output]


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a completion: the generation config's and the tokenizer's EOS."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list | tuple):
        ids.update(int(t) for t in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
