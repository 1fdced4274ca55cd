"""Admission where some groups score alike: the measuring gate learns the share of groups
the trainer finds trainable, and staleness-aware admission counts a rollout in flight as that
share of a batch's slot past max_steps_off_policy=0 (`StalenessAwareAdmission`)."""

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
    assert policy.headroom(EMPTY_WINDOW) == 4
    assert policy.headroom(replace(EMPTY_WINDOW, trainable_share=0.1)) == 40


def test_an_on_policy_race_of_rollouts_that_end_together_stays_the_batch() -> None:
    """At max_steps_off_policy=0 with racers seen to end together, the rollouts beyond the
    batch's missing groups would be cancelled the moment it fills: the share adds none."""
    policy = StalenessAwareAdmission()
    race = replace(EMPTY_WINDOW, max_steps_off_policy=0, latency_tail=1.2)
    assert race.racers_end_together
    assert policy.headroom(race) == policy.headroom(replace(race, trainable_share=0.1)) == 2
