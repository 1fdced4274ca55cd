"""Sampling completions with per-token logprobs from a causal LM, on the CPU.

``sample_row`` draws one row's next token; ``engine.Engine`` calls it for every row of its
batch at every decode step, in its thread. Logprobs
are the model's raw (temperature 1) log-softmax of the token sampled, like vLLM's default:
that is the policy ``train`` computes its importance ratio against, whatever temperature
sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from art_trio import ArtTrioError


class NonFiniteLogits(ArtTrioError, ValueError):
    """The model's logits for a row hold NaN or inf: no token can be sampled from them."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (the stop token included, as vLLM returns it),
    each token's raw logprob, and the top alternatives at each position."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens)
    #: Which policy version produced the tokens, in order: ``(version, tokens)`` runs that
    #: add up to ``len(token_ids)``.
    policy_runs: tuple[tuple[int, int], ...] = ()


def _filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``.

    The set always holds the most probable token: compared in float32, a ``top_p`` below
    float32's smallest number (5e-324 is valid OpenAI) is 0, and no token would be left."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = before < top_p
    keep[..., 0] = True
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@dataclass
class RowSample:
    """A completion being sampled, token by token (``sample_row`` appends to it)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    policy_runs: list[tuple[int, int]] = field(default_factory=list)

    def note_policy(self, version: int) -> None:
        """The token just appended was produced by policy ``version``."""
        if self.policy_runs and self.policy_runs[-1][0] == version:
            self.policy_runs[-1] = (version, self.policy_runs[-1][1] + 1)
        else:
            self.policy_runs.append((version, 1))

    def finish(self, finish_reason: str) -> Completion:
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            top=self.top,
            finish_reason=finish_reason,
            policy_runs=tuple(self.policy_runs),
        )


def sample_row(
    out: RowSample,
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_logprobs: int,
    generator: torch.Generator,
) -> int:
    """Sample one token from one row's next-token ``logits`` (1-D) with its own
    ``generator``; append it, its raw logprob and the ``top_logprobs`` best to ``out``.

    Temperature 0 is greedy (the argmax), and so is a temperature at which
    ``logits / temperature`` overflows float32 (1.2e-37 with a logit beyond +-41; 5e-324,
    which float32 holds as 0). Such a temperature is below max|logit| / 3.4e38, and there a
    token more than 104 x temperature below the best logit has a probability below float32's
    smallest number: sampling would give the argmax anyway, except between logits tied that
    closely. Raises ``NonFiniteLogits`` for a model that produced NaN or inf."""
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits("the model's next-token logits hold NaN or inf")
    logp = torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature if temperature > 0.0 else None
    if scaled is None or not bool(torch.isfinite(scaled).all()):
        token = int(torch.argmax(logp))
    else:
        probs = _filter_top_p(torch.softmax(scaled, dim=-1), top_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
    out.token_ids.append(token)
    out.logprobs.append(float(logp[token]))
    if top_logprobs:
        values, ids = torch.topk(logp, top_logprobs)
        out.top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return token


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
