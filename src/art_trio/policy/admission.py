"""Admission policies: when a rollout may start, which ready groups make a batch, what to evict.

One class per `admission=` mode, chosen once when the run is built (`admission_policy`);
the gate asks the policy how many rollouts may start, the training stage asks it which ready
groups to take and how far to look ahead, the rollout stage and the gate ask it what to evict.
A new policy is one class here, registered with `@admission_mode("name")`; its name also goes
into `Admission`, the type a user's checker reads `admission=` against (importing this module
fails if the two disagree). The settings accept exactly the registered names.

Every decision is a pure function of a `GateSnapshot`, so property tests can hammer them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, get_args

if TYPE_CHECKING:
    from ..messages.values import Delivered
    from .gate_snapshot import GateSnapshot


#: The `admission=` modes (`PipelineSettings.admission`), one registered policy class each.
Admission = Literal["staleness_aware", "eager"]

#: Each `admission=` mode's policy class, built with the run's `max_rollouts_beyond_bound`.
ADMISSION_POLICIES: dict[str, Callable[[int], AdmissionPolicy]] = {}

P = TypeVar("P")


def admission_mode(name: Admission) -> Callable[[P], P]:
    """Register the decorated class as the policy of `admission=name`."""

    def register(cls: P) -> P:
        ADMISSION_POLICIES[name] = cls  # type: ignore[assignment]
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return register


class AdmissionPolicy(Protocol):
    """What the pipeline asks an admission mode."""

    #: The `admission=` value this policy implements.
    name: Admission
    #: Evict (cancel) rollouts in flight once no batch still to be taken can train them.
    cancels_doomed_rollouts: bool
    #: Evict a completed group too old for any batch still to come before it queues.
    drops_stale_early: bool

    def headroom(self, s: GateSnapshot) -> float:
        """How many more rollouts may start now (`math.inf`: occupancy does not bound it)."""
        ...

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        """How many ready groups the trainer holds out of the channel to choose a batch from."""
        ...

    def take_batch(self, ready: list[Delivered], max_batch_size: int) -> list[Delivered]:
        """Remove the next batch's groups from `ready` and return them."""
        ...


def reference_gate_allows(s: GateSnapshot) -> bool:
    """The reference's gate: `policy_version >= next_training_step - max_steps_off_policy`."""
    return s.policy_version >= s.next_training_step - s.max_steps_off_policy


@admission_mode("eager")
class EagerAdmission:
    """The reference as a whole, for comparison: its gate, batches in arrival order, and stale
    groups that run to completion and queue until the trainer discards them."""

    name: Admission
    cancels_doomed_rollouts = False
    drops_stale_early = False

    def __init__(self, beyond_bound: int = 0) -> None:
        pass  # the reference admits nothing past its bound

    def headroom(self, s: GateSnapshot) -> float:
        return math.inf if reference_gate_allows(s) else 0

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        return max_batch_size

    def take_batch(self, ready: list[Delivered], max_batch_size: int) -> list[Delivered]:
        batch = ready[:max_batch_size]
        del ready[:max_batch_size]
        return batch


@admission_mode("staleness_aware")
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
    completed rollouts are seen to end together (`GateSnapshot.racers_end_together`, as at a
    server that batches them), the race is the batch's missing groups plus `beyond_bound`.

    Past `max_steps_off_policy == 0` the same holds for the allowances for late rollouts
    (`on_time_probability`, `beyond_bound`): they pay where latencies are independent, so
    that a rollout missing its window leaves its slot to another. Rollouts that end together
    are on time or late together, and the extra ones would end with the rest only to age out
    behind full batches: there the gate admits the free slots and no more.

    At a shared inference server latency is mostly queueing: in either case no more rollouts
    run at once than the server, at its measured throughput, can finish inside the window
    (`GateSnapshot.load_cap`), so a rollout admitted is one that can finish in time, and a
    race at `max_steps_off_policy == 0` stops where more runners only slow the winners.

    Each admission takes one fresh in-flight slot, so admitting `n` waiters one after the
    other is the same as asking `headroom() > 0` `n` times; the gate asks this once.
    """

    name: Admission
    cancels_doomed_rollouts = True
    drops_stale_early = True

    def __init__(self, beyond_bound: int = 0) -> None:
        self.beyond_bound = beyond_bound

    def headroom(self, s: GateSnapshot) -> float:
        if not reference_gate_allows(s):
            return 0
        # At a shared server one more rollout slows every rollout in flight: never run more
        # than the server can finish inside the window (no cap until it is measured).
        cap = s.load_cap
        by_load = math.inf if cap is None else max(0, cap - s.load)
        return min(by_load, self._window_headroom(s))

    def _window_headroom(self, s: GateSnapshot) -> float:
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
            return max(0, slots - s.queued - s.fresh_in_flight)
        budget = slots + s.straggler_slack(self.beyond_bound) - s.queued
        if budget <= 0:
            return 0
        # Queued groups are sure to be trained; a rollout in flight makes its window only
        # with `on_time_probability` (the gate cancels it when the window closes). So
        # rollouts may start while the expected trainable groups leave a slot free.
        expected_room = budget / s.on_time_probability
        return max(0, math.ceil(expected_room) - s.fresh_in_flight)

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        # A channel's worth, bounded, so backpressure on the rollout workers still works.
        return max(max_batch_size, queue_capacity)

    def take_batch(self, ready: list[Delivered], max_batch_size: int) -> list[Delivered]:
        # Earliest deadline first: a newer group can wait for the next batch, an older one
        # may not get another chance. Stable: arrival order among equal versions.
        ready.sort(key=_deadline)
        batch = ready[:max_batch_size]
        del ready[:max_batch_size]
        return batch


def _deadline(item: Delivered) -> tuple[float, int]:
    return (math.inf if item.version is None else item.version, item.scenario_index)


if set(ADMISSION_POLICIES) != set(get_args(Admission)):
    raise ImportError(f"admission modes registered {sorted(ADMISSION_POLICIES)} differ from "
                      f"the names in Admission {sorted(get_args(Admission))}")


def admission_policy(admission: str, beyond_bound: int = 0) -> AdmissionPolicy:
    """The policy for an `admission=` mode (validated by the settings)."""
    return ADMISSION_POLICIES[admission](beyond_bound)
