"""The on-policy race, in virtual time: narrowed where racers end together, wide elsewhere.

At `max_steps_off_policy=0` admission races rollouts for the batch being collected and the
gate cancels the losers when it fills. Racing pays where the fastest of many end well before
the rest (independent, long-tailed latencies); at a shared server that batches rollouts the
racers end together and each extra one slows the winners. Both properties compare a run
against the same run with the race never narrowed (the reference's race), on the simulator:
trainer utilization must not drop where latencies are independent, and rollouts must be
saved where a server batches them. A rule that judges from a race's winners alone (they look
alike whatever the losers would have taken) breaks the first; see test_mutants.py.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from art_trio.admission import MeasuredSnapshot
from art_trio.sim.simulate import SimReport, SimSpec, simulate
from art_trio.testing.distributions import Constant, Exponential, LogNormal

#: Trainer utilization the rule may cost against the full race where latencies are
#: independent (virtual time: the runs differ only in what admission decides).
UTIL_TOLERANCE = 0.02
#: Share of the full race's rollouts the rule must at most start at a batching server.
BATCHING_SAVING = 0.7
#: Each example is two simulated runs: few examples, every one a whole run.
RACE_EXAMPLES = 8


def full_race(spec: SimSpec) -> SimReport:
    """The run with the race never narrowed, as the reference races."""
    with mock.patch.object(MeasuredSnapshot, "racers_end_together", property(lambda s: False)):
        return simulate(spec)


def _spec(latency: Any, train_s: float, steps: int, trainer: dict[str, int], **kw: Any) -> SimSpec:
    return SimSpec(
        rollout_latency=latency,
        train_time=Constant(train_s),
        steps=steps,
        trainer=dict(trainer, max_steps_off_policy=0, min_batch_size=trainer["max_batch_size"]),
        **kw,
    )


independent = st.builds(
    lambda kind, mean, sigma, cpu_us, workers, batch, seed: _spec(
        Exponential(mean) if kind == "exp" else LogNormal(mean, sigma),
        2 * mean,
        20,
        dict(num_rollout_workers=workers, max_batch_size=batch),
        rollout_cpu_s=cpu_us * 1e-6,
        seed=seed,
    ),
    st.sampled_from(["exp", "lognormal"]),
    st.sampled_from([0.02, 0.05, 0.2]),
    st.floats(1.0, 1.5),
    # CPU the trainer spends per rollout, as a real run does (art-trio bench measures it):
    # it delays every rollout's end alike, which made a race's winners look alike.
    st.sampled_from([0, 50, 100, 200]),
    st.sampled_from([32, 64]),
    st.sampled_from([4, 8]),
    st.integers(0, 3),
)

batching = st.builds(
    lambda capacity, sigma, workers, seed: _spec(
        LogNormal(20.0, sigma),
        15.0,
        30,
        dict(num_rollout_workers=workers, max_batch_size=2),
        inference_capacity=capacity,
        seed=seed,
    ),
    st.sampled_from([1, 2, 4]),
    st.floats(0.05, 0.2),
    st.sampled_from([12, 16, 24]),
    st.integers(0, 3),
)


def prop_independent_race_stays_wide(spec: SimSpec) -> None:
    ruled, wide = simulate(spec), full_race(spec)
    assert ruled.trainer_utilization >= wide.trainer_utilization - UTIL_TOLERANCE, (
        f"the race narrowed on independent latencies: utilization "
        f"{ruled.trainer_utilization:.3f} against {wide.trainer_utilization:.3f} racing all"
    )


def prop_batching_race_narrows(spec: SimSpec) -> None:
    ruled, wide = simulate(spec), full_race(spec)
    assert ruled.rollouts_started <= BATCHING_SAVING * wide.rollouts_started, (
        f"the race stayed wide at a batching server: {ruled.rollouts_started} rollouts started "
        f"against {wide.rollouts_started} racing all"
    )
    assert ruled.rollout_s_per_trained_group <= wide.rollout_s_per_trained_group
    assert ruled.sim_wall_s <= wide.sim_wall_s


@settings(max_examples=RACE_EXAMPLES)
@given(independent)
def test_independent_latencies_keep_the_race_wide(spec: SimSpec) -> None:
    prop_independent_race_stays_wide(spec)


@settings(max_examples=RACE_EXAMPLES)
@given(batching)
def test_a_batching_server_narrows_the_race(spec: SimSpec) -> None:
    prop_batching_race_narrows(spec)
