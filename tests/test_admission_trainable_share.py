"""Admission where some groups score alike: the measuring gate learns the share of groups
the trainer finds trainable, and staleness-aware admission counts a rollout in flight as that
share of a batch's slot (`StalenessAwareAdmission`)."""

from __future__ import annotations

import trio

from art_trio.admission import MeasuringGate, StalenessAwareAdmission


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


def test_where_most_groups_score_alike_more_rollouts_are_admitted() -> None:
    """The window owes a batch two trainable groups; at one in ten trainable, two rollouts in
    flight are not enough to bring them."""
    gate = _gate()
    assert gate.snapshot().trainable_share == 1.0
    headroom_all_trainable = gate.policy.headroom(gate.snapshot())
    assert headroom_all_trainable == 4  # two batches of two: the freshness window
    for _ in range(50):
        _hand_over(gate)
        gate.group_discarded(scored_alike=True)
    assert gate.policy.headroom(gate.snapshot()) >= 5 * headroom_all_trainable
