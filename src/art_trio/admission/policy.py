"""Staleness-aware admission: start a rollout only where a batch still to be taken can train
it, race at `max_steps_off_policy=0` only where racing pays, and cap what runs at once at a
shared server. The policy (`StalenessAwareAdmission`) decides from the `MeasuredSnapshot` its
gate (`MeasuringGate`) takes; docs/architecture.md's "Admission" section tells the whole rule.
"""

from __future__ import annotations

import math
from typing import cast

from ..messages.values import Delivered
from ..policy import admission as kernel_admission
from ..policy.admission import deadline_order
from ..policy.gate_snapshot import GateSnapshot
from .gate import MeasuringGate
from .snapshot import MeasuredSnapshot

#: Floor of the trainable share admission divides by, so that a run whose groups all score
#: alike (it collapses soon after) still asks for a finite number of rollouts.
MIN_TRAINABLE_SHARE = 0.01


def _rollouts_for(groups: float, s: MeasuredSnapshot) -> int:
    """Rollouts in flight that bring `groups` trainable groups, where only
    `trainable_share` of groups do (the rest score alike and are discarded)."""
    return math.ceil(groups / max(MIN_TRAINABLE_SHARE, s.trainable_share))


class StalenessAwareAdmission:
    """Start a rollout only if a batch still to be taken can train it (plus `beyond_bound`);
    take the oldest ready groups first; cancel rollouts no batch can train any more.

    Every group queued and every fresh rollout in flight takes a slot before a rollout
    started now does, so a new rollout is useful only while they leave one free, in the
    freshness window and in what the trainer can consume (`pipeline_target`, from measured
    rollout latency and step period: more in the pipe only ages it). `beyond_bound` extra
    rollouts buy trainer utilization (the slowest rollouts of a batch no longer keep the
    trainer waiting) at the price of some stale ones.

    With `max_steps_off_policy == 0` only the batch being collected can use a rollout, and
    the trainer is waiting on it: until that batch is ready, admission races as many
    rollouts as the reference's, and the gate cancels the losers the moment the batch is
    taken. A race pays only where the fastest of many rollouts end well before the rest; once
    completed rollouts are seen to end together (`MeasuredSnapshot.racers_end_together`, as at a
    server that batches them), the race is the batch's missing groups plus `beyond_bound`.

    Past `max_steps_off_policy == 0` the same holds for the allowances for late rollouts
    (`on_time_probability`, `beyond_bound`): they pay where latencies are independent, so
    that a rollout missing its window leaves its slot to another. Rollouts that end together
    are on time or late together, and the extra ones would end with the rest only to age out
    behind full batches: there the gate admits the free slots and no more.

    At a shared inference server latency is mostly queueing: in either case no more rollouts
    run at once than the server, at its measured throughput, can finish inside the window
    (`MeasuredSnapshot.load_cap`), so a rollout admitted is one that can finish in time, and a
    race at `max_steps_off_policy == 0` stops where more runners only slow the winners.

    Past `max_steps_off_policy == 0` every slot counts trainable groups. Where some groups
    score alike (no learning signal: the trainer discards them), a rollout in flight brings one
    only with the measured `trainable_share`, so the rollouts each slot admits are divided by
    it: counting every rollout as a group a batch takes would starve the trainer where most
    score alike. A trainable group beyond the batch being collected is the next batch's. Not
    at `max_steps_off_policy == 0`, where racers that end together end for one batch: the
    ones beyond its missing groups are cancelled the moment it fills, and at a shared server
    they slow the rest, so the race stays the batch's missing groups plus `beyond_bound`.

    Each admission takes one fresh in-flight slot, so admitting `n` waiters one after the
    other is the same as asking `headroom() > 0` `n` times; the gate asks this once.
    """

    name = "staleness_aware"
    cancels_doomed_rollouts = True
    drops_stale_early = True
    gate_class = MeasuringGate

    def __init__(self, beyond_bound: int = 0) -> None:
        self.beyond_bound = beyond_bound

    def headroom(self, s: GateSnapshot) -> float:
        # Looked up at each call, as the eager policy does (a test may replace the rule).
        if not kernel_admission.reference_gate_allows(s):
            return 0
        s = cast(MeasuredSnapshot, s)  # taken by this policy's own gate (`gate_class`)
        # At a shared server one more rollout slows every rollout in flight: never run more
        # than the server can finish inside the window (no cap until it is measured).
        cap = s.load_cap
        by_load = math.inf if cap is None else max(0, cap - s.load)
        return min(by_load, self._window_headroom(s))

    def _window_headroom(self, s: MeasuredSnapshot) -> float:
        if s.max_steps_off_policy == 0:
            # Starting a rollout does not change `queued`: eager until the batch is covered,
            # unless racing cannot pay (see the class docstring).
            need = s.window_slots - s.queued
            if need <= 0:
                return 0
            if s.racers_end_together:
                return max(0, need + self.beyond_bound - s.fresh_in_flight)
            return math.inf
        slots = s.window_slots
        target = s.pipeline_target
        if target is not None:
            slots = min(slots, target)
        if s.racers_end_together:
            # On time or late together (see the class docstring): the free slots only.
            return max(0, _rollouts_for(slots - s.queued, s) - s.fresh_in_flight)
        budget = slots + s.straggler_slack(self.beyond_bound) - s.queued
        if budget <= 0:
            return 0
        # Queued groups are sure to be trained; a rollout in flight makes its window only
        # with `on_time_probability` (the gate cancels it when the window closes). So
        # rollouts may start while the expected trainable groups leave a slot free.
        return max(0, _rollouts_for(budget / s.on_time_probability, s) - s.fresh_in_flight)

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        # A channel's worth, bounded, so backpressure on the rollout workers still works.
        return max(max_batch_size, queue_capacity)

    def take_batch(self, ready: list[Delivered], max_batch_size: int) -> list[Delivered]:
        # Earliest deadline first: a newer group can wait for the next batch, an older one
        # may not get another chance. Stable: arrival order among equal versions.
        ready.sort(key=deadline_order)
        batch = ready[:max_batch_size]
        del ready[:max_batch_size]
        return batch
