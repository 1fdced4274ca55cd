"""Admission policies: when a rollout may start, which ready groups make a batch, what to evict.

The trainer asks its policy how many rollouts may start (the gate, from a `GateSnapshot`),
which ready groups to take and how far to look ahead (the training stage), and whether to
evict rollouts and groups no batch can train any more. The kernel's own is `EagerAdmission`,
the reference's rule; `admission="staleness_aware"` (the default) is `art_trio.admission`'s.
A policy of your own is any object with these members, passed as `admission=` (see
examples/admission_policy.py); every decision is a pure function of what it is given, so
property tests can hammer it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..messages.values import Delivered
    from .gate_snapshot import GateSnapshot


class AdmissionPolicy(Protocol):
    """What the pipeline asks an admission policy."""

    #: The policy's name (the `admission=` value it implements, or one of your own).
    name: str
    #: Evict (cancel) rollouts in flight once no batch still to be taken can train them.
    cancels_doomed_rollouts: bool
    #: Evict a completed group too old for any batch still to come before it queues.
    drops_stale_early: bool
    @property
    def gate_class(self) -> type[Any] | None:
        """The gate that measures what `headroom` reads: a subclass of the kernel's
        `PolicyGate`, or None for the kernel's own (the counts and mean latency)."""
        ...

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


def deadline_order(item: Delivered) -> tuple[float, int]:
    """Earliest deadline first: oldest `initial_policy_version`, then arrival (a sort key)."""
    return (math.inf if item.version is None else item.version, item.scenario_index)


class EagerAdmission:
    """The reference as a whole: its gate, batches in arrival order, and stale groups that
    run to completion and queue until the trainer discards them."""

    name = "eager"
    cancels_doomed_rollouts = False
    drops_stale_early = False

    def __init__(self, beyond_bound: int = 0) -> None:
        pass  # the reference admits nothing past its bound

    gate_class = None

    def headroom(self, s: GateSnapshot) -> float:
        return math.inf if reference_gate_allows(s) else 0

    def lookahead(self, max_batch_size: int, queue_capacity: int) -> int:
        return max_batch_size

    def take_batch(self, ready: list[Delivered], max_batch_size: int) -> list[Delivered]:
        batch = ready[:max_batch_size]
        del ready[:max_batch_size]
        return batch
