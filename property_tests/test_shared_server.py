"""Runs at one shared inference server always reach max_steps (issue 51, item 1), in virtual
time.

The simulator's processor-sharing server (`SimSpec.inference_capacity`) makes latency grow
with the number of rollouts in flight, so the gate measures it and caps the load
(`GateSnapshot.load_cap`). Cases are the issue's: 16-32 workers against a server serving 1 or
2 at full speed, small batches, `max_steps_off_policy` 0-2, and live resizes of the batch (up
to 8, past what the server finishes in a window) and of the workers at random moments. The
property: every run trains its `max_steps` long before its time limit; a run whose workers all
wait at the gate with nothing in flight and too few groups for a batch never gets there.
`test_mutants.py` shows it catches a gate whose hand-over wakes no waiter.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from art_trio.sim.simulate import SimSpec, simulate
from art_trio.testing.checks import expect
from art_trio.testing.distributions import parse_distribution

PROGRESS = "a shared-server run reaches max_steps"

STEPS = 30
#: Virtual seconds a run may take before it counts as stuck: the slowest of these workloads
#: (latency 20 s served one at a time, batches of 8) trains 30 steps in well under 20,000 s.
TIME_LIMIT_S = 100_000.0

LATENCIES = ("3", "20", "exp:5", "exp:20", "lognormal:10:1")
TRAIN_TIMES = ("1", "5", "15", "40")


@st.composite
def resizes(draw: st.DrawFn) -> tuple[float, dict[str, int]]:
    """One live resize: new batch sizes (often 8), new worker counts, or both."""
    at = draw(st.floats(10.0, 2000.0, allow_nan=False, allow_infinity=False))
    changes: dict[str, int] = {}
    if draw(st.integers(0, 3)) > 0:
        largest = draw(st.one_of(st.just(8), st.integers(1, 8)))
        changes["max_batch_size"] = largest
        changes["min_batch_size"] = draw(st.sampled_from([largest, 1, max(1, largest // 2)]))
    if not changes or draw(st.booleans()):
        changes["num_rollout_workers"] = draw(st.integers(16, 32))
    return at, changes


def batch_to_eight(draw: st.DrawFn) -> tuple[float, dict[str, int]]:
    """The issue's resize: the batch to 8, past what the server finishes in a window."""
    at = draw(st.floats(10.0, 2000.0, allow_nan=False, allow_infinity=False))
    return at, {"min_batch_size": 8, "max_batch_size": 8}


@st.composite
def shared_server_specs(draw: st.DrawFn, *, as_reported: bool = False) -> SimSpec:
    """A shared-server workload; `as_reported`: only the issue's (a server serving one at
    full speed, `max_steps_off_policy=1`, the batch resized to 8 once)."""
    largest = draw(st.integers(2, 4))
    trainer: dict[str, Any] = dict(
        num_rollout_workers=draw(st.integers(16, 32)),
        min_batch_size=draw(st.sampled_from([largest, 1, largest // 2])),
        max_batch_size=largest,
        max_steps_off_policy=1 if as_reported else draw(st.sampled_from([1, 1, 0, 2])),
    )
    if as_reported:
        changes = (batch_to_eight(draw),)
    else:
        changes = tuple(sorted(draw(st.lists(resizes(), max_size=2)), key=lambda r: r[0]))
    return SimSpec(
        rollout_latency=parse_distribution(draw(st.sampled_from(LATENCIES))),
        train_time=parse_distribution(draw(st.sampled_from(TRAIN_TIMES))),
        steps=STEPS,
        inference_capacity=1 if as_reported else draw(st.sampled_from([1, 1, 2])),
        seed=draw(st.integers(0, 2**16)),
        trainer=trainer,
        resizes=changes,
    )


def prop_shared_server_progress(spec: SimSpec) -> None:
    report = simulate(spec, time_limit_s=TIME_LIMIT_S)
    expect(
        not report.stalled and report.steps == STEPS,
        PROGRESS,
        f"{spec.describe()} with {dict(spec.trainer)}: {report.steps} of {STEPS} steps in "
        f"{report.sim_wall_s:g} s of virtual time"
        + (" (cut short by the time limit: stuck)" if report.stalled else ""),
    )


@given(shared_server_specs())
def test_shared_server_runs_with_resizes_reach_max_steps(spec: SimSpec) -> None:
    prop_shared_server_progress(spec)
