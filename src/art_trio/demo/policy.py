"""A tiny numpy policy: a softmax over a few one-token answers, conditioned on the prompt.

This module is pure numpy, with no I/O and no event loop. The server samples from it and the
backend trains it. What you may rely on:

* ``VOCAB`` is fixed. Every completion is exactly one token, one of these words.
* ``Weights`` are never changed in place. A training step returns new arrays, so a snapshot
  that the server is still answering from always keeps its own weights.
* ``log_probs(weights, features)`` gives the raw (temperature-1) log-probabilities. The server
  reports these as a token's ``logprob``, and ``policy_gradient`` reads them back as the
  sampling policy, so the importance ratio is exact for temperature-1 rollouts.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

#: The answers the policy can give. The first three are the task's answers; the rest are
#: plausible wrong words (reward 0), so the policy has something to unlearn.
VOCAB: tuple[str, ...] = ("yes", "no", "maybe", "sure", "never", "perhaps")
TOKEN_INDEX: dict[str, int] = {word: i for i, word in enumerate(VOCAB)}

#: Feature 0 is a constant bias. The other features are hashed unigrams and bigrams of the
#: prompt, so the policy can treat "respond with yes or no" differently from
#: "just respond with 'maybe', 'no', 'yes'".
NUM_FEATURES = 64

#: The initial bias of each wrong word. With three task words at bias 0, three wrong words at
#: this bias hold about 1% of the mass, so the untrained policy scores about
#: 0.99 * (1 + 0.75 + 0.5) / 3 = 0.74 on yes/no/maybe.
WRONG_WORD_BIAS = -4.6

LossFn = Literal["cispo", "ppo"]

_WORD = re.compile(r"[a-z]+")


def featurize(text: str) -> FloatArray:
    """Map a prompt to a feature vector of length ``NUM_FEATURES``.

    Deterministic across processes: it hashes with CRC-32, not Python's salted ``hash``.
    """
    words = _WORD.findall(text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    x = np.zeros(NUM_FEATURES, dtype=np.float64)
    x[0] = 1.0
    for gram in grams:
        x[1 + zlib.crc32(gram.encode()) % (NUM_FEATURES - 1)] = 1.0
    active = float(np.count_nonzero(x[1:]))
    if active:
        # Scale so a long prompt does not move the logits further than a short one.
        x[1:] /= np.sqrt(active)
    return x


def content_text(content: object) -> str:
    """The text of a chat message's ``content``: a string, or a list of ``{"type": "text"}``
    parts (other parts, like images, carry no text the policy can see)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def prompt_features(messages: Sequence[Mapping[str, object]]) -> FloatArray:
    """Features of a chat prompt: all its messages' text, whatever their role.

    The server and the trainer both call this, so a trained token is scored on exactly the
    features it was sampled with.
    """
    return featurize("\n".join(content_text(m.get("content")) for m in messages))


#: Standard deviation of the untrained per-prompt weights: enough that prompts differ, small
#: enough that every seed starts near the uniform policy's 0.75.
DEFAULT_INIT_SCALE = 0.15


def initial_weights(seed: int, init_scale: float = DEFAULT_INIT_SCALE) -> FloatArray:
    """The untrained policy: near-uniform over yes/no/maybe, plus seeded per-prompt noise."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, init_scale, size=(len(VOCAB), NUM_FEATURES))
    weights[:, 0] = 0.0
    for word in VOCAB[3:]:
        weights[TOKEN_INDEX[word], 0] = WRONG_WORD_BIAS
    return freeze(weights)


def freeze(array: FloatArray) -> FloatArray:
    """Mark an array read-only, so a served snapshot cannot be changed by accident."""
    array.setflags(write=False)
    return array


def log_softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def log_probs(weights: FloatArray, features: FloatArray) -> FloatArray:
    """Log-probabilities over ``VOCAB`` at temperature 1."""
    return log_softmax(weights @ features)


def sample(
    weights: FloatArray,
    features: FloatArray,
    n: int,
    rng: np.random.Generator,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[int]:
    """Draw ``n`` token indices. Temperature 0 is greedy; ``top_p`` < 1 is nucleus sampling."""
    logits = weights @ features
    if temperature <= 0.0:
        return [int(np.argmax(logits))] * n
    probs = np.exp(log_softmax(logits / temperature))
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < top_p
        mask = np.zeros_like(probs)
        mask[order[keep]] = 1.0
        probs = probs * mask
        probs /= probs.sum()
    return [int(i) for i in rng.choice(len(VOCAB), size=n, p=probs)]


@dataclass(frozen=True)
class Sample:
    """One trained token: its prompt features, which answer, and how it was sampled.

    ``old_logprob`` is the logprob the server reported when the token was sampled; None means
    "unknown", which is treated like ART does: as sampled from the current policy (ratio 1).
    """

    features: FloatArray
    token: int
    advantage: float
    old_logprob: float | None = None


@dataclass
class Adam:
    """Adam's moment estimates, updated functionally (``step`` returns new weights)."""

    shape: tuple[int, int]
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    t: int = 0
    m: FloatArray = field(init=False)
    v: FloatArray = field(init=False)

    def __post_init__(self) -> None:
        self.m = np.zeros(self.shape)
        self.v = np.zeros(self.shape)

    def step(self, weights: FloatArray, grad: FloatArray, learning_rate: float) -> FloatArray:
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * grad
        self.v = self.beta2 * self.v + (1 - self.beta2) * grad * grad
        m_hat = self.m / (1 - self.beta1**self.t)
        v_hat = self.v / (1 - self.beta2**self.t)
        return freeze(weights - learning_rate * m_hat / (np.sqrt(v_hat) + self.eps))


@dataclass(frozen=True)
class GradientResult:
    loss: float
    grad: FloatArray
    metrics: dict[str, float]


def group_advantages(rewards: Sequence[float], *, normalize: bool = True) -> list[float]:
    """GRPO advantages, as ART computes them: reward minus the group mean, divided by the
    group's (population) standard deviation + 1e-6 when ``normalize``."""
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64)
    centered = r - r.mean()
    if normalize:
        centered = centered / (r.std() + 1e-6)
    return [float(a) for a in centered]


def policy_gradient(
    weights: FloatArray,
    samples: Sequence[Sample],
    *,
    loss_fn: LossFn = "cispo",
    epsilon: float | None = None,
    epsilon_high: float | None = None,
) -> GradientResult:
    """Loss and gradient of ART's RL objectives, averaged over the sampled tokens.

    With ``r = exp(logprob_now - old_logprob)`` and advantage ``A``:

    * ``ppo``: ``-min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)``, eps defaults to 0.2.
    * ``cispo``: ``-stopgrad(clip(r, 1 - eps, 1 + eps_high)) * A * logprob_now``: a truncated
      importance weight times the REINFORCE gradient; eps defaults to 1.0, eps_high to 4.0.

    The defaults are those of ``art.loss.loss_fn``.
    """
    if loss_fn == "ppo":
        eps = 0.2 if epsilon is None else epsilon
        eps_high = eps if epsilon_high is None else epsilon_high
    elif loss_fn == "cispo":
        eps = 1.0 if epsilon is None else epsilon
        eps_high = 4.0 if epsilon_high is None else epsilon_high
    else:
        raise ValueError(f"loss_fn must be 'cispo' or 'ppo', not {loss_fn!r}")

    grad = np.zeros_like(weights)
    if not samples:
        return GradientResult(0.0, grad, {"loss": 0.0, "grad_norm": 0.0})

    total_loss = 0.0
    ratios: list[float] = []
    entropies: list[float] = []
    clipped = 0
    for s in samples:
        logp = log_probs(weights, s.features)
        probs = np.exp(logp)
        entropies.append(float(-(probs * logp).sum()))
        new_lp = float(logp[s.token])
        old_lp = new_lp if s.old_logprob is None else s.old_logprob
        ratio = float(np.exp(new_lp - old_lp))
        ratios.append(ratio)
        clipped_ratio = min(max(ratio, 1.0 - eps), 1.0 + eps_high)
        if clipped_ratio != ratio:
            clipped += 1
        # d logprob[token] / d logits = onehot(token) - probs; logits = W @ x.
        dlogp = -probs
        dlogp[s.token] += 1.0
        dlogp_dw = np.outer(dlogp, s.features)
        a = s.advantage
        if loss_fn == "ppo":
            unclipped_obj, clipped_obj = ratio * a, clipped_ratio * a
            total_loss -= min(unclipped_obj, clipped_obj)
            # The gradient flows only through the unclipped branch, when it is the minimum.
            if unclipped_obj <= clipped_obj:
                grad -= a * ratio * dlogp_dw
        else:
            total_loss -= clipped_ratio * a * new_lp
            grad -= clipped_ratio * a * dlogp_dw

    count = len(samples)
    grad /= count
    loss = total_loss / count
    return GradientResult(
        loss,
        grad,
        {
            "loss": loss,
            "grad_norm": float(np.linalg.norm(grad)),
            "entropy": float(np.mean(entropies)),
            "importance_ratio": float(np.mean(ratios)),
            "frac_clipped": clipped / count,
        },
    )
