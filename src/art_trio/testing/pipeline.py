"""Check YOUR pipeline's configuration against every scheduler invariant, in virtual time.

`check_pipeline` runs the real `PipelineTrainer` with your settings (the keyword arguments you
give `PipelineTrainer`), your rollout latencies, your scenarios and, if you give it, your
rollout function, under trio's `MockClock`: the run's wall time is the trainer's own work, not
the latencies (about 0.1 s of wall time a training step here, however long the step). It runs
once to the end and once stopped half way and resumed by a new trainer on the same model
directory, and checks on what the doubles saw (never on the trainer's own word):

- the off-policy bound (`max_steps_off_policy`) and the mean policy-age bound
  (`limit_mean_steps_off_policy`), and your own `max_policy_age` if you state one;
- batch bounds (`min_batch_size` <= batch <= `max_batch_size`, but a final batch);
- conservation: every scenario taken ends exactly once, the counters agree; exactly-once
  across the stop and the resume;
- consecutive policy versions, `max_steps`, termination (no deadlock);
- the eval schedule (`eval_every_n_steps`, `eval_at_start`), one eval at a time;
- collapse (`discard_queue_multiplier`) and the groups channel's capacity.

A broken invariant raises `PipelineCheckFailed` (an AssertionError) naming the invariant and
the case. `explore_pipeline` is the Hypothesis-driven variant: it draws latencies, how many
scenarios, when to stop (and settings, if you give a strategy) and shrinks a failure to a
minimal case. It needs Hypothesis (`pip install "art-trio[testing]"`); `check_pipeline`
does not. The pytest plugin (fixture `art_trio_pipeline`) offers both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from art_trio import ArtTrioError
from art_trio.testing import checks
from art_trio.testing.distributions import LatencyDist, parse_distribution
from art_trio.testing.harness import (
    DEFAULT_SCENARIOS,
    Case,
    CaseResult,
    Config,
    RolloutPlan,
    run_case,
    run_resume_case,
)

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

#: What `rollout_latency` may be: seconds (every rollout), seconds per scenario (cycled), a
#: distribution (`art_trio.sim.Exponential(30.0)`, ...) or its short form ("lognormal:30:1.5",
#: as `art-trio simulate` takes), or a function of the scenario's index.
Latency = float | Sequence[float] | LatencyDist | str | Callable[[int], float]


class PipelineCheckFailed(ArtTrioError, AssertionError):
    """A scheduler invariant broke on a case; `case` is the (minimal, if explored) case."""

    def __init__(self, message: str, case: Case, tag: str | None) -> None:
        super().__init__(message)
        self.case = case
        #: The invariant broken (one of `art_trio.testing.checks`' tags), if one was.
        self.tag = tag


@dataclass(frozen=True)
class PipelineReport:
    """What a passing check ran: the run to the end and the stopped-and-resumed one."""

    case: Case
    full: CaseResult
    resumed: CaseResult | None
    #: The invariants checked, by tag.
    checked: tuple[str, ...]

    @property
    def steps(self) -> int:
        """Training steps of the run to the end."""
        return len(self.full.runs[0].calls)

    @property
    def virtual_seconds(self) -> float:
        """How long the run to the end took, in virtual seconds."""
        return self.full.runs[0].ended_at


def latencies(rollout_latency: Latency, n: int, *, seed: int = 0) -> tuple[float, ...]:
    """The latency of each of `n` scenarios' rollouts, drawn reproducibly from `seed`."""
    if isinstance(rollout_latency, str):
        rollout_latency = parse_distribution(rollout_latency)
    if isinstance(rollout_latency, LatencyDist):
        draws = rollout_latency.sample_n(np.random.default_rng(seed), n)
        values = tuple(float(x) for x in draws)
    elif isinstance(rollout_latency, int | float):
        values = (float(rollout_latency),) * n
    elif callable(rollout_latency):
        values = tuple(float(rollout_latency(i)) for i in range(n))
    else:
        given = tuple(float(x) for x in rollout_latency)
        if not given:
            raise ValueError("rollout_latency: an empty sequence; give at least one duration")
        values = tuple(given[i % len(given)] for i in range(n))
    bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(
            f"rollout_latency gave {bad[0]!r}: latencies are finite seconds >= 0 (virtual time)"
        )
    return values


def _seconds(name: str, value: float | Sequence[float]) -> tuple[float, ...]:
    values = (float(value),) if isinstance(value, int | float) else tuple(map(float, value))
    if not values or any(not (math.isfinite(v) and v >= 0) for v in values):
        raise ValueError(f"{name}={value!r}: give finite seconds >= 0 (one, or a sequence)")
    return values


def _scenarios(source: Iterable[Any] | int | None) -> tuple[Any, ...] | int:
    if source is None:
        return DEFAULT_SCENARIOS
    if isinstance(source, int):
        if source < 0:
            raise ValueError(f"source={source}: a number of scenarios is >= 0")
        return source
    # Materialized once: a resumed run must be given the same scenarios (the trainer checks
    # their fingerprints), as a real restart re-reading the same dataset would.
    return tuple(source)


def make_case(
    settings: Mapping[str, Any],
    *,
    rollout_latency: Latency = 1.0,
    source: Iterable[Any] | int | None = None,
    rollout_fn: Callable[..., Any] | None = None,
    train_seconds: float | Sequence[float] = 1.0,
    eval_seconds: float | Sequence[float] = 1.0,
    stop_at: float | None = None,
    seed: int = 0,
) -> Case:
    """The harness case for a user's pipeline (see `check_pipeline` for the arguments)."""
    config = Config.from_settings(settings)
    scenarios = _scenarios(source)
    n = scenarios if isinstance(scenarios, int) else len(scenarios)
    plans = tuple(
        RolloutPlan(latency=t, rewards=(0.0, 1.0)) for t in latencies(rollout_latency, n, seed=seed)
    )
    evals = config.eval_every_n_steps > 0 or config.eval_at_start
    return Case(
        config=config,
        plans=plans,
        train_seconds=_seconds("train_seconds", train_seconds),
        eval_seconds=_seconds("eval_seconds", eval_seconds) if evals else None,
        stop_at=stop_at,
        scenarios=None if isinstance(scenarios, int) else scenarios,
        rollout_fn=rollout_fn,
    )


def _tag(exc: AssertionError) -> str | None:
    text = str(exc)
    return text[1 : text.index("]")] if text.startswith("[") and "]" in text else None


def check_case(
    case: Case, *, resume: bool = True, max_policy_age: int | None = None
) -> PipelineReport:
    """Run `case` to its end (and, with `resume`, stopped and resumed); check every invariant.

    Raises AssertionError (tagged with the invariant, e.g. "[off-policy bound] ...") on the
    first one broken. The stop of the resumed run is `case.stop_at`, or else half way through
    the run to the end (in virtual time).
    """
    full = run_case(dataclasses.replace(case, stop_at=None))
    checked = [checks.TERMINATION]
    checks.check_ran_cleanly(full)
    for check, tag in (
        (checks.check_off_policy, checks.OFF_POLICY),
        (checks.check_mean_bound, checks.MEAN_BOUND),
        (checks.check_batch_bounds, checks.BATCH_BOUNDS),
        (checks.check_conservation, checks.CONSERVATION),
        (checks.check_versions, checks.VERSIONS),
        (checks.check_max_steps, checks.TERMINATION),
        (checks.check_evals, checks.EVAL),
        (checks.check_collapse, checks.COLLAPSE),
        (checks.check_capacity, checks.CAPACITY),
    ):
        check(full)
        checked.append(tag)
    if max_policy_age is not None:
        checks.check_policy_age(full, max_policy_age)
        checked.append(checks.POLICY_AGE)
    resumed = None
    if resume:
        stop_at = case.stop_at if case.stop_at is not None else full.runs[0].ended_at / 2
        resumed = run_resume_case(dataclasses.replace(case, stop_at=stop_at))
        for _ in range(3):
            if case.stop_at is not None or resumed.runs[0].stop_requested:
                break
            # trio runs the tasks of one scheduling batch in a random order, so this run can
            # end sooner than the full one did: stop half way through this one instead.
            stop_at = resumed.runs[0].ended_at / 2
            resumed = run_resume_case(dataclasses.replace(case, stop_at=stop_at))
        checks.check_resume(resumed)
        checks.check_evals(resumed)
        checks.check_capacity(resumed)
        if max_policy_age is not None:
            checks.check_policy_age(resumed, max_policy_age)
        checked.append(checks.RESUME)
    return PipelineReport(
        case=case, full=full, resumed=resumed, checked=tuple(dict.fromkeys(checked))
    )


def describe(case: Case) -> str:
    """A case as a person reads it (and as `check_pipeline` arguments that reproduce it)."""
    config = case.config
    defaults = Config.from_settings({})
    changed = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(Config)
        if f.name != "extra" and getattr(config, f.name) != getattr(defaults, f.name)
    } | dict(config.extra)
    lines = [
        f"  settings={changed!r}  (the others: the trainer's defaults)",
        f"  rollout_latency={[round(p.latency, 6) for p in case.plans]!r}",
    ]
    if case.scenarios is not None:
        shown = ", ".join(repr(s) for s in case.scenarios[:5])
        more = f", ... ({len(case.scenarios)} in all)" if len(case.scenarios) > 5 else ""
        lines.append(f"  source=[{shown}{more}]")
    else:
        lines.append(f"  source={len(case.plans)}  (generated scenarios)")
    if case.rollout_fn is not None:
        lines.append(f"  rollout_fn={getattr(case.rollout_fn, '__qualname__', case.rollout_fn)}")
    lines.append(f"  train_seconds={list(case.train_seconds)!r}")
    if case.eval_seconds is not None:
        lines.append(f"  eval_seconds={list(case.eval_seconds)!r}")
    lines.append(f"  stop_at={case.stop_at!r}")
    return "\n".join(lines)


def _failed(exc: AssertionError, case: Case, note: str = "") -> PipelineCheckFailed:
    return PipelineCheckFailed(
        f"{exc}\n\nThe case{note}:\n{describe(case)}", case=case, tag=_tag(exc)
    )


def check_pipeline(
    settings: Mapping[str, Any],
    *,
    rollout_latency: Latency = 1.0,
    source: Iterable[Any] | int | None = None,
    rollout_fn: Callable[..., Any] | None = None,
    train_seconds: float | Sequence[float] = 1.0,
    eval_seconds: float | Sequence[float] = 1.0,
    stop_at: float | None = None,
    resume: bool = True,
    max_policy_age: int | None = None,
    seed: int = 0,
) -> PipelineReport:
    """Run your pipeline's configuration in virtual time and check every scheduler invariant.

    Args:
        settings: the keyword arguments you give `PipelineTrainer` (`num_rollout_workers`,
            `min_batch_size`, `max_steps_off_policy`, ...); those left out take the trainer's
            defaults. Invalid ones raise the trainer's own ValueError.
        rollout_latency: how long each scenario's rollout takes, in (virtual) seconds: one
            number, one per scenario (cycled), an `art_trio.sim` distribution or its short
            form ("exp:30", "lognormal:30:1.5"), or a function of the scenario's index.
        source: your scenarios (materialized once; a resumed run gets the same ones), or a
            number of generated ones (default 24).
        rollout_fn: your rollout function, called after the rollout's latency with (model,
            scenario, config); it must return an `art.TrajectoryGroup` without real I/O
            (virtual time). An `async def` is asyncio code as in ART (run through
            trio-asyncio); mark an anyio/trio one with `art_trio.trio_native`. None: each
            rollout returns a group of two trajectories with rewards 0 and 1.
        train_seconds: how long a training step takes (one number, or several, cycled).
        eval_seconds: how long an eval takes (likewise).
        stop_at: when the resumed check's first run is stopped (default: half way).
        resume: also run the stop-and-resume check (exactly-once across the two runs).
        max_policy_age: your algorithm's own bound: no trained group may be older than this
            many steps (`step - 1 - initial_policy_version`), whatever the settings allow.
        seed: draws of a latency distribution.

    Returns a `PipelineReport`; raises `PipelineCheckFailed` (an AssertionError) naming the
    broken invariant and the case.
    """
    __tracebackhide__ = True  # pytest shows the failure, not this function's lines
    case = make_case(
        settings,
        rollout_latency=rollout_latency,
        source=source,
        rollout_fn=rollout_fn,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        stop_at=stop_at,
        seed=seed,
    )
    try:
        return check_case(case, resume=resume, max_policy_age=max_policy_age)
    except PipelineCheckFailed:
        raise
    except AssertionError as exc:
        raise _failed(exc, case) from None


def explore_pipeline(
    settings: Mapping[str, Any] | SearchStrategy[Mapping[str, Any]],
    *,
    rollout_latency: Latency | SearchStrategy[float] = 1.0,
    source: Iterable[Any] | int | None = None,
    rollout_fn: Callable[..., Any] | None = None,
    train_seconds: float | Sequence[float] | SearchStrategy[float] = 1.0,
    eval_seconds: float | Sequence[float] | SearchStrategy[float] = 1.0,
    resume: bool = True,
    max_policy_age: int | None = None,
    max_examples: int = 50,
    derandomize: bool = True,
) -> None:
    """The Hypothesis-driven `check_pipeline`: many cases, a failure shrunk to a minimal one.

    Each argument may also be a Hypothesis strategy (settings as a strategy of dicts, latency
    of floats, ...). Hypothesis draws how many of your scenarios to use (a prefix of
    `source`), each rollout's latency (from the strategy, or from a sample of the
    distribution, shortest first) and when the resumed run is stopped; on a failure it shrinks
    the case and `PipelineCheckFailed` shows the minimal one. `derandomize` (default) makes
    every run explore the same cases, so a CI failure reproduces locally.
    """
    __tracebackhide__ = True
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import settings as hypothesis_settings

    from art_trio.testing.strategies import pipeline_cases

    strategy = pipeline_cases(
        settings,
        rollout_latency=rollout_latency,
        source=source,
        rollout_fn=rollout_fn,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
    )
    last: list[tuple[Case, AssertionError]] = []

    @hypothesis_settings(
        max_examples=max_examples,
        derandomize=derandomize,
        database=None,
        deadline=None,
        print_blob=False,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(strategy)
    def explore(case: Case) -> None:
        try:
            check_case(case, resume=resume, max_policy_age=max_policy_age)
        except AssertionError as exc:
            last.append((case, exc))
            raise

    try:
        explore()
    except AssertionError as exc:
        # Hypothesis replays the minimal failing case last.
        case, error = last[-1] if last else (None, exc)
        if case is None:
            raise
        raise _failed(error, case, " (minimal, after shrinking)") from None


__all__ = [
    "Latency",
    "PipelineCheckFailed",
    "PipelineReport",
    "check_case",
    "check_pipeline",
    "describe",
    "explore_pipeline",
    "latencies",
    "make_case",
]
