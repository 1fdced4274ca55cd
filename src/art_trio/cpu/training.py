"""One clipped policy-gradient step on LoRA weights, from ART's tokenized trajectories.

The input is what ART's own ``tokenize_trajectory_groups`` yields (``TokenizedResult``: token
ids, assistant mask, the sampling logprobs, the group-normalized advantage and the per-
trajectory weight). The objective is ART's, written here for a CPU and whole sequences:

* ``ppo``: ``-min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)`` per trainable token, with the
  importance ratio ``r`` against the logprobs the tokens were sampled with (defaults
  eps = eps_high = 0.2);
* ``cispo``: ``-clip(r, 1 - eps, 1 + eps_high).detach() * A * logprob`` (defaults 1.0 / 4.0).

A token whose sampling logprob is missing (NaN) is treated as sampled from the current
policy (ratio 1), as ART does. Each trajectory counts once: its tokens are averaged with the
tokenizer's weight (1 / its trainable tokens) and the batch loss is the mean over sequences.
With ``kl_penalty_coef`` > 0 and reference logprobs, each token's advantage is shifted by
``coef * (mean KL - token KL)`` (KL estimated as ``new - ref`` logprob), ART's sample penalty.

Advantages are GRPO's (``reward - group mean``, divided by ``std + 1e-6`` when normalized), as
ART's tokenizer computes them, but reckoned on rewards scaled into [-1, 1] first, so any finite
rewards give finite advantages (ART's own sum overflows to NaN for rewards near 1.7e308).
Non-finite rewards, and a step whose loss or gradient is not finite, are refused with
``NonFiniteTrainingError`` before anything changes: a NaN never reaches the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from art_trio import ArtTrioError

LossFn = Literal["cispo", "ppo"]
#: Sequences per forward/backward pass: bounds the logits' memory (vocab 49k x tokens).
MICRO_BATCH = 8


class NonFiniteTrainingError(ArtTrioError, ValueError):
    """A reward, advantage, loss or gradient is not a finite number; the step was not taken
    and the weights and optimizer are as before it. The message names what and where."""


def check_rewards(groups: Iterable[Iterable[Any]]) -> None:
    """Refuse a NaN or infinite reward, naming its group and trajectory (ART's trainer calls
    ``backend.train`` directly, so the backend refuses whatever reaches it)."""
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group):
            reward = trajectory.reward
            if not isinstance(reward, int | float) or not math.isfinite(reward):
                raise NonFiniteTrainingError(
                    f"trajectory {t} of trajectory group {g} has reward {reward!r}: rewards "
                    f"must be finite numbers; fix the rollout that scored it (nothing was "
                    f"trained)"
                )


def group_advantages(rewards: Sequence[float], *, scale: bool) -> list[float]:
    """GRPO advantages of one group, ``(r - mean) / (std + 1e-6)`` (or ``r - mean`` when not
    ``scale``), equal to ART's where ART's arithmetic does not overflow.

    The rewards are divided by a power of two above their largest magnitude first (exactly),
    which keeps every sum finite; normalized advantages do not depend on that factor but for
    the 1e-6, which is scaled with them. Raises ``NonFiniteTrainingError`` when unnormalized
    advantages themselves exceed a float (a reward spread over 1.7e308)."""
    if not rewards or min(rewards) == max(rewards):  # no spread, no advantage (rounding aside)
        return [0.0 for _ in rewards]
    exponent = math.frexp(max(abs(r) for r in rewards))[1]  # 2**exponent > every |r|
    scaled = [math.ldexp(r, -exponent) for r in rewards]
    mean = math.fsum(scaled) / len(scaled)
    deviations = [x - mean for x in scaled]
    if not scale:
        try:
            return [math.ldexp(d, exponent) for d in deviations]
        except OverflowError:
            raise NonFiniteTrainingError(
                f"rewards {list(rewards)!r} spread too far for unnormalized advantages (they "
                f"exceed a float): normalize advantages or keep rewards within +-1e300"
            ) from None
    std = math.sqrt(math.fsum(d * d for d in deviations) / len(deviations))
    eps = math.ldexp(1e-6, -exponent)
    return [d / (std + eps) for d in deviations]


@dataclass(frozen=True)
class Sequence_:
    """One training sequence, from a ``TokenizedResult``."""

    token_ids: list[int]
    assistant_mask: list[int]
    logprobs: list[float]
    advantage: float
    weight: float


def sequences_from_results(results: Sequence[Any]) -> list[Sequence_]:
    return [
        Sequence_(
            token_ids=list(r.token_ids),
            assistant_mask=list(r.assistant_mask),
            logprobs=[float(x) for x in r.logprobs],
            advantage=float(r.advantage),
            weight=float(r.weight),
        )
        for r in results
        if any(r.assistant_mask)
    ]


def _pad(batch: Sequence[Sequence_], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(s.token_ids) for s in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), length), dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.bool)
    old = torch.full((len(batch), length), math.nan)
    for i, s in enumerate(batch):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(s.assistant_mask, dtype=torch.bool)
        old[i, :n] = torch.tensor(s.logprobs)
    # Position t's logits predict token t + 1: align targets, masks and old logprobs to them.
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "targets": ids[:, 1:],
        "mask": mask[:, 1:],
        "old": old[:, 1:],
    }


def token_logprobs(model: Any, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, length - 1]``: the logprob of each next token under ``model``."""
    logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits[
        :, :-1, :
    ]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, tensors["targets"].unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class StepConfig:
    loss_fn: LossFn = "cispo"
    epsilon: float | None = None
    epsilon_high: float | None = None
    kl_penalty_coef: float = 0.0
    max_grad_norm: float | None = 1.0


def _epsilons(config: StepConfig) -> tuple[float, float]:
    if config.loss_fn == "ppo":
        low = 0.2 if config.epsilon is None else config.epsilon
        high = low if config.epsilon_high is None else config.epsilon_high
    else:
        low = 1.0 if config.epsilon is None else config.epsilon
        high = 4.0 if config.epsilon_high is None else config.epsilon_high
    return low, high


def train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[Sequence_],
    config: StepConfig,
    *,
    pad_id: int,
    reference_logprobs: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> dict[str, float]:
    """One optimizer step (gradients accumulated over micro-batches); returns its metrics."""
    low, high = _epsilons(config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    model.train()
    total_loss = 0.0
    tokens = 0
    clipped = 0
    kl_sum = 0.0
    ratio_sum = 0.0
    count = len(sequences)
    for start in range(0, count, MICRO_BATCH):
        tensors = _pad(sequences[start : start + MICRO_BATCH], pad_id)
        mask = tensors["mask"]
        new = token_logprobs(model, tensors)
        old = torch.where(torch.isnan(tensors["old"]), new.detach(), tensors["old"])
        batch = sequences[start : start + MICRO_BATCH]
        advantages = torch.tensor([s.advantage for s in batch]).unsqueeze(-1).expand_as(new)
        weights = torch.tensor([s.weight for s in batch]).unsqueeze(-1).expand_as(new)
        if config.kl_penalty_coef > 0.0 and reference_logprobs is not None:
            with torch.no_grad():
                ref = reference_logprobs(tensors)
            kl = (new.detach() - ref) * mask
            mean_kl = kl.sum() / mask.sum().clamp(min=1)
            advantages = advantages + config.kl_penalty_coef * (mean_kl - kl) * mask
            kl_sum += float(kl.sum())
        ratio = torch.exp(new - old)
        clipped_ratio = torch.clamp(ratio, 1.0 - low, 1.0 + high)
        if config.loss_fn == "ppo":
            per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        else:
            per_token = -(clipped_ratio.detach() * advantages * new)
        loss = (per_token * weights * mask).sum() / count
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            model.eval()
            raise NonFiniteTrainingError(
                f"the loss of sequences {start}-{start + len(batch) - 1} is {float(loss.detach())} "
                f"(advantages {[s.advantage for s in batch]!r}): step not taken, the "
                f"weights and optimizer are unchanged"
            )
        loss.backward()
        total_loss += float(loss.detach())
        tokens += int(mask.sum())
        clipped += int(((ratio != clipped_ratio) & mask).sum())
        ratio_sum += float((ratio.detach() * mask).sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, config.max_grad_norm if config.max_grad_norm else float("inf")
    )
    if not torch.isfinite(grad_norm):
        # Clipping a non-finite norm multiplies every gradient by NaN: never step on it.
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        raise NonFiniteTrainingError(
            f"the gradient norm is {float(grad_norm)} (loss {total_loss}): step not taken, "
            f"the weights and optimizer are unchanged"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    metrics = {
        "loss": total_loss,
        "grad_norm": float(grad_norm),
        "num_trajectories": float(count),
        "num_trainable_tokens": float(tokens),
        "data/step_trainable_assistant_tokens": float(tokens),
        "frac_clipped": clipped / max(tokens, 1),
        "mean_importance_ratio": ratio_sum / max(tokens, 1),
    }
    if config.kl_penalty_coef > 0.0 and reference_logprobs is not None:
        metrics["kl_policy_ref"] = kl_sum / max(tokens, 1)
    return metrics


@torch.no_grad()
def sequence_logprob(model: Any, token_ids: list[int], start: int) -> float:
    """Sum of the logprobs of ``token_ids[start:]`` given what precedes each (for tests and
    for checking that a step moved the policy)."""
    ids = torch.tensor([token_ids])
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "targets": ids[:, 1:],
    }
    logp = token_logprobs(model, tensors)[0]
    return float(logp[start - 1 :].sum())
