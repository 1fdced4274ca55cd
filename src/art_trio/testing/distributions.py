"""Duration distributions, sampled reproducibly by index, and their command-line forms.

A :class:`LatencyDist` draws durations in seconds from a caller's ``numpy`` Generator;
:class:`IndexedDraws` makes draw number ``i`` depend only on the seed and ``i``, so rollouts of
scenario ``i`` take the same time under every trainer, whatever order they start in.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Constant",
    "Empirical",
    "Exponential",
    "IndexedDraws",
    "LatencyDist",
    "LogNormal",
    "describe_distribution",
    "draws_for",
    "parse_distribution",
    "parse_seconds",
    "read_seconds",
]

class LatencyDist(ABC):
    """A distribution of durations in seconds, sampled from a caller-supplied Generator."""

    @property
    @abstractmethod
    def mean(self) -> float:
        """The distribution's expected value, in seconds."""

    @abstractmethod
    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` non-negative durations."""

    @abstractmethod
    def describe(self) -> str:
        """Short human-readable form for tables, e.g. ``exp(50ms)``."""

    def sample(self, rng: np.random.Generator) -> float:
        """Draw one duration."""
        return float(self.sample_n(rng, 1)[0])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g}ms"


@dataclass(frozen=True)
class Constant(LatencyDist):
    """Always ``seconds`` (``0`` means "yield once and go on")."""

    seconds: float

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError("Constant latency must be >= 0")

    @property
    def mean(self) -> float:
        return self.seconds

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.seconds, dtype=float)

    def describe(self) -> str:
        return _ms(self.seconds)


@dataclass(frozen=True)
class Exponential(LatencyDist):
    """Exponential with the given mean (memoryless; many short, a few long)."""

    mean_s: float

    def __post_init__(self) -> None:
        if self.mean_s <= 0:
            raise ValueError("Exponential mean must be > 0")

    @property
    def mean(self) -> float:
        return self.mean_s

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean_s, n)

    def describe(self) -> str:
        return f"exp({_ms(self.mean_s)})"


@dataclass(frozen=True)
class LogNormal(LatencyDist):
    """Log-normal parameterised by its *mean* (not median) and the log-space sigma.

    ``mu = ln(mean) - sigma**2 / 2`` so the mean stays put as ``sigma`` grows and only the
    tail gets heavier: sigma 1.5 puts the median at a third of the mean.
    """

    mean_s: float
    sigma: float

    def __post_init__(self) -> None:
        if self.mean_s <= 0 or self.sigma < 0:
            raise ValueError("LogNormal needs mean > 0 and sigma >= 0")

    @property
    def mean(self) -> float:
        return self.mean_s

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean_s) - self.sigma**2 / 2
        return rng.lognormal(mu, self.sigma, n)

    def describe(self) -> str:
        return f"lognorm({_ms(self.mean_s)},s={self.sigma:g})"


@dataclass(frozen=True)
class Empirical(LatencyDist):
    """Resample (with replacement) from measured durations, e.g. production rollout times."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Empirical needs at least one sample")
        if min(self.samples) < 0:
            raise ValueError("Empirical samples must be >= 0")

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples))

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.samples, dtype=float), size=n, replace=True)

    def describe(self) -> str:
        return f"empirical(n={len(self.samples)},mean={_ms(self.mean)})"


class IndexedDraws:
    """Draw number ``i`` of a seeded stream, whatever order the indices are asked for in.

    Draws are generated in fixed-size chunks in index order, so ``draws[i]`` depends only on
    the seed and ``i``. Rollouts of scenario ``i`` therefore take the same time under every
    trainer, and a trainer that starts scenarios in a different order is not handed different
    luck.
    """

    CHUNK = 4096

    def __init__(
        self, draw: Callable[[np.random.Generator, int], np.ndarray], seed: Sequence[int]
    ) -> None:
        self._draw = draw
        self._rng = np.random.default_rng(list(seed))
        self._chunks: list[np.ndarray] = []

    def __getitem__(self, index: int) -> float:
        if index < 0:
            raise IndexError(index)
        chunk = index // self.CHUNK
        while len(self._chunks) <= chunk:
            self._chunks.append(self._draw(self._rng, self.CHUNK))
        return float(self._chunks[chunk][index % self.CHUNK])


def draws_for(dist: LatencyDist, seed: Sequence[int]) -> Callable[[int], float]:
    """Draw number ``i`` of ``dist`` for ``seed``, as a function of ``i``."""
    # A constant needs no table; skipping it keeps the memory workload's own footprint flat.
    if isinstance(dist, Constant):
        value = dist.seconds
        return lambda _index: value
    return IndexedDraws(dist.sample_n, seed).__getitem__


_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|min|m|h)?\s*$")


def parse_seconds(text: str) -> float:
    """``"30"``, ``"30s"``, ``"500ms"``, ``"40us"``, ``"2m"``/``"2min"``, ``"1.5h"`` ->
    seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (examples: 30, 30s, 500ms, 2m, 1.5h)")
    return float(match.group(1)) * _UNITS[match.group(2) or ""]


def read_seconds(path: str | Path) -> tuple[float, ...]:
    """Durations in seconds from a file: a JSON list, or numbers separated by whitespace or
    commas (``#`` starts a comment). Each entry may carry a unit (``500ms``, ``2m``)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        values = json.loads(text)
        if not isinstance(values, list):
            raise ValueError(f"{path}: expected a JSON list of seconds")
        samples = tuple(float(v) for v in values)
    else:
        tokens = [
            token
            for line in text.splitlines()
            for token in re.split(r"[,\s]+", line.split("#", 1)[0])
            if token
        ]
        samples = tuple(parse_seconds(token) for token in tokens)
    if not samples:
        raise ValueError(f"{path}: no durations found")
    return samples


def parse_distribution(text: str) -> LatencyDist:
    """A duration distribution from its short form (all durations in seconds unless suffixed).

    - ``30`` or ``const:30``: always 30 s;
    - ``exp:30``: exponential with mean 30 s;
    - ``lognormal:30:1.5``: log-normal with mean 30 s and log-space sigma 1.5;
    - ``file:PATH`` (or ``empirical:PATH``): resample the durations listed in PATH
      (see :func:`read_seconds`).
    """
    forms = "forms: 30, const:30, exp:30, lognormal:30:1.5, file:latencies.txt"
    kind, sep, rest = text.partition(":")
    if not sep:
        try:
            return Constant(parse_seconds(text))
        except ValueError:
            raise ValueError(
                f"not a duration or a distribution: {text!r} ({forms}; durations as 30, "
                "500ms, 2m)"
            ) from None
    kind = kind.strip().lower()
    if kind in ("file", "empirical"):
        return Empirical(read_seconds(rest))
    args = [a for a in re.split(r"[:,]", rest) if a.strip()]
    if kind in ("const", "constant") and len(args) == 1:
        return Constant(parse_seconds(args[0]))
    if kind in ("exp", "exponential") and len(args) == 1:
        return Exponential(parse_seconds(args[0]))
    if kind in ("lognormal", "lognorm") and len(args) == 2:
        return LogNormal(parse_seconds(args[0]), float(args[1]))
    raise ValueError(f"not a distribution: {text!r} ({forms})")


def describe_distribution(dist: LatencyDist) -> str:
    """Short form in seconds (``exp(30s)``); ``LatencyDist.describe`` speaks milliseconds."""
    if isinstance(dist, Constant):
        return f"{dist.seconds:g}s"
    if isinstance(dist, Exponential):
        return f"exp({dist.mean_s:g}s)"
    if isinstance(dist, LogNormal):
        return f"lognormal({dist.mean_s:g}s, sigma {dist.sigma:g})"
    if isinstance(dist, Empirical):
        return f"empirical({len(dist.samples)} samples, mean {dist.mean:.4g}s)"
    return dist.describe()
