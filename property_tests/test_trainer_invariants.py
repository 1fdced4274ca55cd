"""The scheduler's invariants on the real PipelineTrainer, in virtual time (one property each).

Each `test_<invariant>` runs generated cases through `harness.run_case` and applies the check
of the same name from `checks.py`. The `prop_*` functions are the properties themselves, so
`test_mutants.py` can run them against deliberately broken trainers.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given

from art_trio.testing import checks
from art_trio.testing.harness import (
    Case,
    CaseResult,
    Config,
    RolloutPlan,
    run_case,
    run_resume_case,
)
from art_trio.testing.strategies import (
    COMMON_FAILURES,
    TOKEN_FAILURES,
    cases,
    forced_stop_cases,
    resume_cases,
)

# Generated runs include ones whose every rollout fails on purpose; the warning that says
# so is the run's, not this test's finding.
pytestmark = pytest.mark.filterwarnings("ignore:no step was trained:RuntimeWarning")


def prop_off_policy_bound(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_off_policy(result)
    checks.check_mean_bound(result)


def prop_batch_bounds(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_batch_bounds(result)


def prop_conservation(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_conservation(result)


def prop_versions(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_versions(result)


def prop_max_steps_and_termination(case: Case) -> None:
    checks.check_max_steps(run_case(case))


def prop_eval_schedule(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_evals(result)


def prop_collapse(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_collapse(result)


def prop_channel_capacity(case: Case) -> None:
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_capacity(result)


def prop_resume(case: Case) -> None:
    checks.check_resume(run_resume_case(case))


def prop_in_flight_bounds(case: Case) -> None:
    """A backend that updates weights under running rollouts: both bounds hold on the
    tokens' own versions, and every scenario still ends exactly once."""
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_off_policy(result)
    checks.check_mean_bound(result)
    checks.check_conservation(result)


def prop_all_failed_group(case: Case) -> None:
    checks.check_all_failed(run_case(case))


def prop_resize_keeps_every_invariant(case: Case) -> None:
    """Worker counts changed at random moments: every single-run invariant still holds."""
    result = run_case(case)
    checks.check_ran_cleanly(result)
    checks.check_off_policy(result)
    checks.check_mean_bound(result)
    checks.check_batch_bounds(result)
    checks.check_conservation(result)
    checks.check_versions(result)
    checks.check_max_steps(result)
    checks.check_capacity(result)


def prop_future_versions_never_train(case: Case) -> None:
    """Trajectories claiming a policy version 1-8 ahead of the trainer's."""
    result = run_case(case)
    expect_no_timeout(result)
    checks.check_future_versions(result)


def prop_forced_stop_in_train(case: Case) -> None:
    """`request_stop(force=True)` inside `backend.train`, then a resume: the batch in the
    call gets a fate, and every invariant holds across the two runs."""
    checks.check_resume(run_resume_case(case))


def expect_no_timeout(result: CaseResult) -> None:
    for run in result.runs:
        checks.expect(not run.timed_out, checks.TERMINATION, f"run {run.index} hangs")


#: Strategy of each property (the mutation tests draw from the same ones).
STRATEGIES = {
    prop_off_policy_bound: cases(failures=COMMON_FAILURES + TOKEN_FAILURES),
    prop_batch_bounds: cases(),
    prop_conservation: cases(failures=COMMON_FAILURES + TOKEN_FAILURES),
    prop_versions: cases(),
    prop_max_steps_and_termination: cases(),
    prop_eval_schedule: cases(evals=True),
    prop_collapse: cases(collapse=True),
    prop_channel_capacity: cases(),
    prop_resume: resume_cases(),
    prop_all_failed_group: cases(failures=("all_failed", "raise", "partial")),
    prop_resize_keeps_every_invariant: cases(resize=True),
    prop_future_versions_never_train: cases(future=True),
    prop_forced_stop_in_train: forced_stop_cases(),
    prop_in_flight_bounds: cases(failures=COMMON_FAILURES + TOKEN_FAILURES, in_flight=True),
}


@given(STRATEGIES[prop_off_policy_bound])
def test_off_policy_bound(case: Case) -> None:
    """1. Every group in the batch producing step s+1 started at version >= s - M."""
    prop_off_policy_bound(case)


@given(STRATEGIES[prop_batch_bounds])
def test_batch_bounds(case: Case) -> None:
    """2. min_batch_size <= len(batch) <= max_batch_size, but for a final batch."""
    prop_batch_bounds(case)


#: Minimized counterexamples this suite found. These two: a rollout cancelled in flight, by
#: the stop's grace period running out or by the run ending at max_steps, was counted nowhere
#: (taken, but not dropped_at_stop); fixed in 204e564.
STOP_CANCELS_IN_FLIGHT = Case(
    config=Config(num_rollout_workers=1, min_batch_size=1, max_batch_size=1,
                  max_steps_off_policy=0, shutdown_grace_seconds=0.0),
    plans=(RolloutPlan(latency=2.0, rewards=(0.0, 1.0)),),
    train_seconds=(0.0,),
    stop_at=1.0,
)
MAX_STEPS_CANCELS_IN_FLIGHT = Case(
    config=Config(num_rollout_workers=2, min_batch_size=1, max_batch_size=1,
                  max_steps_off_policy=1, max_steps=1),
    plans=(RolloutPlan(latency=0.0, rewards=(0.0, 1.0)),
           RolloutPlan(latency=5.0, rewards=(0.0, 1.0))),
    train_seconds=(1.0,),
)
#: Kept after the fix: admission under "staleness_aware" divided by the measured rollout
#: latency, so when the first rollouts took no (virtual) time and two steps had started, the
#: rollout stage crashed with ZeroDivisionError in GateSnapshot.on_time_probability.
ZERO_LATENCY_ROLLOUTS = Case(
    config=Config(num_rollout_workers=1, min_batch_size=1, max_batch_size=1,
                  max_steps_off_policy=1),
    plans=tuple(RolloutPlan(latency=0.0, rewards=(0.0, 1.0)) for _ in range(4)),
    train_seconds=(1.0,),
)


@example(STOP_CANCELS_IN_FLIGHT)
@example(MAX_STEPS_CANCELS_IN_FLIGHT)
@given(STRATEGIES[prop_conservation])
def test_conservation(case: Case) -> None:
    """3. Every scenario taken ends exactly once; the counters agree with the doubles."""
    prop_conservation(case)


@given(STRATEGIES[prop_versions])
def test_versions(case: Case) -> None:
    """4. Published versions are consecutive; initial <= final version on every trajectory."""
    prop_versions(case)


@example(ZERO_LATENCY_ROLLOUTS)
@given(STRATEGIES[prop_max_steps_and_termination])
def test_max_steps_and_termination(case: Case) -> None:
    """5. max_steps is never exceeded; a finite source ends train() in bounded virtual time."""
    prop_max_steps_and_termination(case)


@given(STRATEGIES[prop_eval_schedule])
def test_eval_schedule(case: Case) -> None:
    """6. Exactly the reference's eval steps run, never two at once."""
    prop_eval_schedule(case)


@given(STRATEGIES[prop_collapse])
def test_collapse(case: Case) -> None:
    """7. Training stops exactly when held zero-variance groups reach the limit."""
    prop_collapse(case)


@given(STRATEGIES[prop_channel_capacity])
def test_channel_capacity(case: Case) -> None:
    """8. The groups channel never holds more than its capacity."""
    prop_channel_capacity(case)


@given(STRATEGIES[prop_resume])
def test_resume(case: Case) -> None:
    """9. Stop at a random time, resume with a new trainer: 1-5 hold, nothing trained twice."""
    prop_resume(case)


@given(STRATEGIES[prop_all_failed_group])
def test_all_failed_group(case: Case) -> None:
    """An all-failed group fails the run with ART's RuntimeError; the state is persisted."""
    prop_all_failed_group(case)


@given(STRATEGIES[prop_resize_keeps_every_invariant])
def test_resize_keeps_every_invariant(case: Case) -> None:
    """11. `trainer.resize(num_rollout_workers=...)` at random moments breaks no invariant."""
    prop_resize_keeps_every_invariant(case)


@given(STRATEGIES[prop_future_versions_never_train])
def test_future_versions_never_train(case: Case) -> None:
    """12. A trajectory from an unpublished policy version stops the run; never trained."""
    prop_future_versions_never_train(case)


@given(STRATEGIES[prop_forced_stop_in_train])
def test_forced_stop_in_train(case: Case) -> None:
    """13. A forced stop inside backend.train: fates conserved, resume trains nothing twice."""
    prop_forced_stop_in_train(case)


@given(STRATEGIES[prop_in_flight_bounds])
def test_in_flight_bounds(case: Case) -> None:
    prop_in_flight_bounds(case)
