"""The stall watchdog never reports a slow run that moves (issue 37, point 4), in virtual time.

Cases are the suite's own (evals, stops, failures, every admission mode), with every duration
scaled to seconds, minutes or ten minutes of virtual time. With `stall_seconds` set just above
the longest rollout, train call and eval of the case, or left at "auto" where all of them stay
under its floor, the run must finish without a single report: whatever is in flight ends
within its own duration, and a rollout, a step or an eval ending is the run moving.
`test_mutants.py` shows the property catches a watchdog that counts only finished steps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from art_trio.testing import checks
from art_trio.testing.harness import Case, run_case
from art_trio.testing.strategies import cases

# Generated runs include ones whose every rollout fails on purpose; the warning that says
# so is the run's, not this test's finding.
pytestmark = pytest.mark.filterwarnings("ignore:no step was trained:RuntimeWarning")

#: `stall_seconds="auto"` never goes below this (restating
#: art_trio.config.settings.STALL_FLOOR_SECONDS).
AUTO_FLOOR = 600.0


def _longest(case: Case) -> float:
    durations = [p.latency for p in case.plans] + list(case.train_seconds)
    durations += list(case.eval_seconds or ())
    return max(durations, default=0.0)


@st.composite
def slow_cases(draw: st.DrawFn) -> Case:
    """A suite case with its durations scaled (up to 20 s x 600: over three hours each), and
    `stall_seconds` just above the longest, or "auto" when all stay under its floor."""
    case = draw(cases(evals=True))
    auto = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 20.0] if auto else [1.0, 60.0, 600.0]))
    scaled = replace(
        case,
        plans=tuple(replace(p, latency=p.latency * scale) for p in case.plans),
        train_seconds=tuple(t * scale for t in case.train_seconds),
        eval_seconds=None
        if case.eval_seconds is None
        else tuple(t * scale for t in case.eval_seconds),
        stop_at=None if case.stop_at is None else case.stop_at * scale,
    )
    stall: Any = "auto" if auto else _longest(scaled) * 1.01 + 1.0
    if auto:
        assert _longest(scaled) < AUTO_FLOOR
    extra = (("stall_seconds", stall), ("stall_action", "log"))
    return replace(scaled, config=replace(scaled.config, extra=extra))


def prop_no_false_stall(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_no_false_stall(result)


@given(slow_cases())
def test_a_slow_run_that_moves_is_never_reported_stalled(case: Case) -> None:
    prop_no_false_stall(case)
