"""Admission where some groups score alike: the measuring gate learns the share of groups
the trainer finds trainable, and staleness-aware admission counts a rollout in flight as that
share of a batch's slot where latency does not grow with load (`StalenessAwareAdmission`)."""

from __future__ import annotations

from dataclasses import replace

import trio

from art_trio.admission import MeasuredSnapshot, MeasuringGate, StalenessAwareAdmission


def _gate() -> MeasuringGate:
    return MeasuringGate(
        start_step=0,
        max_steps_off_policy=1,
        max_batch_size=2,
        policy=StalenessAwareAdmission(),
        clock=lambda: 0.0,
    )


def _hand_over(gate: MeasuringGate) -> None:
    gate.hand_over(trio.run(gate.admit))


def test_the_share_is_exactly_one_while_no_group_scores_alike() -> None:
    """Runs without zero-variance groups decide exactly as before the share was measured."""
    gate = _gate()
    for step in range(1, 300):
        gate.begin_training(step, batch_size=1 + step % 5)
        gate.publish(step)
    assert gate.snapshot().trainable_share == 1.0


def test_the_share_follows_the_groups_judged() -> None:
    gate = _gate()
    for step in range(1, 101):
        # Each step: nine groups discarded as scoring alike, one trained.
        for _ in range(9):
            _hand_over(gate)
            gate.group_discarded(scored_alike=True)
        _hand_over(gate)
        gate.begin_training(step, batch_size=1)
        gate.publish(step)
    assert 0.08 < gate.snapshot().trainable_share < 0.12
    # Stale groups and groups dropped at stop say nothing of how groups score.
    before = gate.snapshot().trainable_share
    _hand_over(gate)
    gate.group_discarded()
    assert gate.snapshot().trainable_share == before


#: The load model (in-flight count, mean latency there, completions): latency measured flat
#: across loads (rollouts that do not wait for each other), and growing with load as a
#: saturated shared server's does.
FLAT = ((2, 30.0, 5.0), (8, 31.0, 5.0))
QUEUEING = ((2, 30.0, 5.0), (8, 120.0, 5.0))
EMPTY_WINDOW = MeasuredSnapshot(
    policy_version=0,
    next_training_step=0,
    max_steps_off_policy=1,
    max_batch_size=2,
    queued=0,
    fresh_in_flight=0,
)


def test_where_most_groups_score_alike_more_rollouts_are_admitted() -> None:
    """The window owes two batches of two trainable groups; at one group in ten trainable,
    four rollouts in flight would bring less than one."""
    policy = StalenessAwareAdmission()
    assert policy.headroom(replace(EMPTY_WINDOW, load_latency=FLAT)) == 4
    alike = replace(EMPTY_WINDOW, load_latency=FLAT, trainable_share=0.1)
    assert policy.headroom(alike) == 40


def test_at_a_shared_server_or_unmeasured_the_share_admits_no_more() -> None:
    """Where latency grows with load (or nothing says it does not), more rollouts in flight
    bring no more groups per second, only older ones: the window's own count stands."""
    policy = StalenessAwareAdmission()
    for load_latency in (QUEUEING, (), FLAT[:1]):
        alike = replace(EMPTY_WINDOW, load_latency=load_latency, trainable_share=0.1)
        assert policy.headroom(alike) == 4, load_latency
