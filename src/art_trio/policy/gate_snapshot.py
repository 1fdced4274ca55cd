"""`GateSnapshot`: what an admission decision depends on, at one instant (frozen), and the
freshness window that follows from it. The gate takes it; admission policies read it. A policy
that measures more (`art_trio.admission`) extends it with its own fields.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..messages.values import cheap_init


def completed_count(times: tuple[float, ...]) -> int:
    """How many of the sorted recent rollout times are completed rollouts': cancelled ones
    count as infinite and sort last, so the completed are the prefix before them (found in
    log time: the in-flight cancel window asks on every snapshot)."""
    return bisect.bisect_left(times, math.inf)


@cheap_init
@dataclass(frozen=True, slots=True)
class GateSnapshot:
    """What an admission decision depends on, at one instant."""

    policy_version: int
    next_training_step: int
    max_steps_off_policy: int
    max_batch_size: int
    #: Groups delivered by rollouts and not yet in a batch (in the channel or ready).
    queued: int
    #: Admitted rollouts not yet delivered whose groups can still be trained (those the gate
    #: has not cancelled).
    fresh_in_flight: int
    #: Mean rollout latency, measured (None until the first rollout ends).
    rollout_latency: float | None = None
    #: Mean time between two training steps starting, measured (None until two have).
    step_period: float | None = None
    #: Recent rollouts' times, sorted; `math.inf` for a rollout cancelled before it ended
    #: (it missed its window). Empty until the gate has collected some.
    recent_rollout_times: tuple[float, ...] = ()
    #: Every admitted rollout not yet ended, fresh or not: the load this trainer puts on a
    #: shared inference server (None: take `fresh_in_flight`).
    in_flight: int | None = None

    @property
    def training(self) -> bool:
        """A batch has been taken and `backend.train` is producing `next_training_step`."""
        return self.next_training_step > self.policy_version

    @property
    def min_fresh_version(self) -> int:
        """Oldest `initial_policy_version` the next batch still to be taken accepts."""
        # The next batch to be taken produces policy_version+1 while collecting, and
        # next_training_step+1 while training; it accepts versions >= its step-1-M.
        return self.next_training_step - self.max_steps_off_policy

    @property
    def window_slots(self) -> int:
        """Groups that batches not yet taken can still train from a rollout started now.

        A rollout starting now samples `policy_version`; the batches that accept it are those
        for steps policy_version+1 .. policy_version+M+1 not already taken.
        """
        return self.batches_left * self.max_batch_size

    @property
    def batches_left(self) -> int:
        """Batches not yet taken that would train a rollout started now."""
        return self.max_steps_off_policy + (0 if self.training else 1)

    def held_by(
        self, headroom: Callable[[GateSnapshot], float]
    ) -> tuple[str, str, str] | None:
        """A measuring policy's own reason for refusing every rollout now, where the window
        would admit one: (what holds, a short why, the whole sentence); None: none."""
        return None
