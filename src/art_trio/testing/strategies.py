"""Hypothesis strategies for `harness.Case`: configurations, rollout plans, durations, stops.

Needs Hypothesis (`pip install "art-trio[testing]"`). `pipeline_cases` draws cases around a
user's own pipeline (see `art_trio.testing.pipeline.explore_pipeline`); the others are the
repository's property suite's, public so that a user can reuse them.

Durations mix small integers (many events at the same virtual instant, where ordering bugs
live) with arbitrary floats. Sizes stay small: the invariants are about interleavings, and
small cases shrink to readable counterexamples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from art_trio.testing.distributions import LatencyDist, parse_distribution

from .harness import DEFAULT_SCENARIOS, Case, Config, Resize, RolloutPlan

durations = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0]),
    st.floats(min_value=0.0, max_value=20.0, allow_nan=False, allow_infinity=False),
)

rewards = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=0, max_size=4).map(tuple)


@st.composite
def rollout_plans(
    draw: st.DrawFn, *, failures: tuple[str, ...] = (), future: bool = False,
    in_flight: bool = False,
) -> RolloutPlan:
    """One scenario's rollout: latency, rewards (zero-variance and one-trajectory groups
    included), sometimes a failure from `failures` and, with `future`, sometimes a
    trajectory claiming a policy version 1-8 ahead of the trainer's; with `in_flight`, the
    tokens it decodes in each of 1-4 chunks of its latency."""
    failure = None
    if failures and draw(st.integers(0, 5)) == 0:
        failure = draw(st.sampled_from(failures))
    future_by = draw(st.integers(1, 8)) if future and draw(st.integers(0, 3)) == 0 else 0
    # Mostly groups with signal, so batches form; zero variance is common enough anyway.
    group_rewards = draw(
        st.one_of(
            st.just((0.0, 1.0)),
            st.just((1.0, 0.5, 0.0)),
            rewards,
        )
    )
    tokens = (
        tuple(draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))) if in_flight else (4,)
    )
    return RolloutPlan(
        latency=draw(durations), rewards=group_rewards, failure=failure, future_by=future_by,
        tokens=tokens,
    )


#: Failures for the main properties ("all_failed" makes the run fail by design: separately).
COMMON_FAILURES = ("raise", "wrong_type", "nan", "partial")
#: Non-finite and negative `completion_tokens` (errored groups), drawn besides the common
#: failures by the properties they threaten: the bounds and conservation. (Kept out of the
#: others so that their derandomized examples, and their mutants' budgets, stay as measured.)
TOKEN_FAILURES = ("tokens_inf", "tokens_nan", "tokens_negative")


@st.composite
def staleness_bounds(draw: st.DrawFn) -> dict[str, Any]:
    """The hard bound alone (as the reference), or with ART 0.5.20's mean bound, or the mean
    bound alone (`max_steps_off_policy=None`)."""
    mean = draw(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.5])))
    hard = st.integers(0, 3)
    return {
        "max_steps_off_policy": draw(hard if mean is None else st.one_of(st.none(), hard)),
        "limit_mean_steps_off_policy": mean,
    }


@st.composite
def configs(
    draw: st.DrawFn,
    *,
    evals: bool = False,
    collapse: bool = False,
    max_steps: bool = True,
    grace: tuple[float | None, ...] = (0.0, 2.0, 30.0, None),
) -> Config:
    min_batch = draw(st.integers(1, 3))
    max_batch = min_batch + draw(st.integers(0, 3))
    return Config(
        num_rollout_workers=draw(st.integers(1, 6)),
        min_batch_size=min_batch,
        max_batch_size=max_batch,
        **draw(staleness_bounds()),
        queue_maxsize=draw(st.one_of(st.none(), st.integers(1, 6))),
        max_steps=draw(st.one_of(st.none(), st.integers(0, 8))) if max_steps else None,
        eval_every_n_steps=draw(st.integers(0, 4)) if evals else 0,
        eval_at_start=draw(st.booleans()) if evals else False,
        discard_queue_multiplier=draw(st.integers(1, 3)) if collapse else 100,
        admission=draw(st.sampled_from(["staleness_aware", "eager"])),
        shutdown_grace_seconds=draw(st.sampled_from(grace)),
        max_rollouts_beyond_bound=draw(st.one_of(st.none(), st.integers(0, 3))),
    )


@st.composite
def resizes_(draw: st.DrawFn) -> Resize:
    """A live resize: a new worker count, maybe new batch sizes, maybe a new queue size."""
    batch_sizes = None
    if draw(st.booleans()):
        min_batch = draw(st.integers(1, 3))
        batch_sizes = (min_batch, min_batch + draw(st.integers(0, 3)))
    return Resize(
        at=draw(durations),
        num_rollout_workers=draw(st.integers(1, 6)),
        batch_sizes=batch_sizes,
        queue_maxsize=draw(st.one_of(st.none(), st.integers(1, 6))),
    )


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    evals: bool = False,
    collapse: bool = False,
    stop: bool = True,
    failures: tuple[str, ...] = COMMON_FAILURES,
    max_scenarios: int = 24,
    max_steps: bool = True,
    grace: tuple[float | None, ...] = (0.0, 2.0, 30.0, None),
    resize: bool = False,
    future: bool = False,
    in_flight: bool = False,
) -> Case:
    """A whole case: config, one plan per scenario, durations, maybe a stop (and, with
    `resize`, worker counts changed at random moments; with `future`, some trajectories
    from a policy the trainer has not published; with `in_flight`, a backend that updates
    weights under running rollouts, whose tokens then span several policies)."""
    config = draw(configs(evals=evals, collapse=collapse, max_steps=max_steps, grace=grace))
    if in_flight:
        config = dataclasses.replace(config, in_flight_updates=True)
    # A uniform size rather than Hypothesis' list sizes, which favour tiny lists: the
    # interesting interleavings need a few steps.
    n = draw(st.integers(0, max_scenarios))
    plans = tuple(
        draw(
            st.lists(
                rollout_plans(failures=failures, future=future, in_flight=in_flight),
                min_size=n,
                max_size=n,
            )
        )
    )
    train_seconds = tuple(draw(st.lists(durations, min_size=1, max_size=3)))
    eval_seconds = tuple(draw(st.lists(durations, min_size=1, max_size=3))) if evals else None
    stop_at = draw(st.one_of(st.none(), durations)) if stop else None
    resizes = tuple(draw(st.lists(resizes_(), min_size=1, max_size=4))) if resize else ()
    return Case(
        config=config,
        plans=plans,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        stop_at=stop_at,
        resizes=resizes,
    )


@st.composite
def resume_cases(
    draw: st.DrawFn,
    *,
    second_stop: bool = True,
    max_steps: bool = True,
    grace: tuple[float | None, ...] = (0.0, 2.0, 30.0, None),
) -> Case:
    """A case that is stopped at a random time, then resumed (maybe stopped again)."""
    case = draw(cases(evals=draw(st.booleans()), stop=False, max_steps=max_steps, grace=grace))
    return Case(
        config=case.config,
        plans=case.plans,
        train_seconds=case.train_seconds,
        eval_seconds=case.eval_seconds,
        stop_at=draw(durations),
        second_stop_at=draw(st.one_of(st.none(), durations)) if second_stop else None,
    )


def _latency_strategy(rollout_latency: Any) -> st.SearchStrategy[float]:
    """Each rollout's latency: the user's strategy, else a sample of their distribution
    (sorted, so a failure shrinks towards the shortest latencies), else their values."""
    if isinstance(rollout_latency, st.SearchStrategy):
        return rollout_latency
    if isinstance(rollout_latency, str):
        rollout_latency = parse_distribution(rollout_latency)
    if isinstance(rollout_latency, LatencyDist):
        sample = rollout_latency.sample_n(np.random.default_rng(0), 64)
        return st.sampled_from(sorted(float(x) for x in sample))
    if isinstance(rollout_latency, int | float):
        return st.just(float(rollout_latency))
    if callable(rollout_latency):
        return st.integers(0, 63).map(lambda i: float(rollout_latency(i)))
    return st.sampled_from(sorted(float(x) for x in rollout_latency))


def _seconds_strategy(value: Any) -> st.SearchStrategy[tuple[float, ...]]:
    if isinstance(value, st.SearchStrategy):
        return st.lists(value, min_size=1, max_size=3).map(tuple)
    if isinstance(value, int | float):
        return st.just((float(value),))
    return st.just(tuple(float(v) for v in value))


@st.composite
def pipeline_cases(
    draw: st.DrawFn,
    settings: Mapping[str, Any] | st.SearchStrategy[Mapping[str, Any]],
    *,
    rollout_latency: Any = 1.0,
    source: Iterable[Any] | int | None = None,
    rollout_fn: Callable[..., Any] | None = None,
    train_seconds: float | Sequence[float] | st.SearchStrategy[float] = 1.0,
    eval_seconds: float | Sequence[float] | st.SearchStrategy[float] = 1.0,
) -> Case:
    """Cases around a user's pipeline: their settings (or a strategy of them), a prefix of
    their scenarios (at least one), a latency per rollout, and when the resumed run stops.

    Every argument is as for `art_trio.testing.pipeline.check_pipeline`, or a strategy.
    """
    chosen = draw(settings) if isinstance(settings, st.SearchStrategy) else settings
    config = Config.from_settings(chosen)
    if source is None or isinstance(source, int):
        total = DEFAULT_SCENARIOS if source is None else source
        scenarios = None
    else:
        scenarios = tuple(source)
        total = len(scenarios)
    n = draw(st.integers(min(1, total), total))
    plans = tuple(
        RolloutPlan(latency=draw(_latency_strategy(rollout_latency)), rewards=(0.0, 1.0))
        for _ in range(n)
    )
    evals = config.eval_every_n_steps > 0 or config.eval_at_start
    return Case(
        config=config,
        plans=plans,
        train_seconds=draw(_seconds_strategy(train_seconds)),
        eval_seconds=draw(_seconds_strategy(eval_seconds)) if evals else None,
        stop_at=draw(durations),
        scenarios=None if scenarios is None else scenarios[:n],
        rollout_fn=rollout_fn,
    )


@st.composite
def forced_stop_cases(draw: st.DrawFn) -> Case:
    """A case whose first run is force-stopped from inside the `backend.train` call of step
    1-4 (if it gets that far), then resumed to its end."""
    case = draw(cases(stop=False))
    return Case(
        config=case.config,
        plans=case.plans,
        train_seconds=case.train_seconds,
        force_stop_in_train=draw(st.integers(1, 4)),
    )


__all__ = [
    "COMMON_FAILURES",
    "TOKEN_FAILURES",
    "cases",
    "configs",
    "durations",
    "forced_stop_cases",
    "pipeline_cases",
    "resume_cases",
    "rollout_plans",
]
