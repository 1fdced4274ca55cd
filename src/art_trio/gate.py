"""Policy versions and admission: the one place that decides whether a rollout may start.

Vocabulary (the reference's):
- `policy_version` is the step of the weights rollouts sample from now;
- `next_training_step` is the step the trainer is producing: equal to `policy_version` while
  it collects a batch, one more while `backend.train` runs;
- the batch that produces step s+1 accepts a group only if its `initial_policy_version` is
  at least `s - max_steps_off_policy`, so a rollout that starts at version v can still be
  trained by the batches for steps v+1 .. v+max_steps_off_policy+1: its freshness window.

Admission and freshness are decided here and nowhere else, so the rollout side (may a
rollout start?) and the training side (is this group still fresh?) can never drift apart.
The decisions are pure functions of a `GateSnapshot`, so property tests can hammer them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from .settings import Admission


@dataclass(frozen=True, slots=True)
class GateSnapshot:
    """Everything an admission decision depends on, at one instant."""

    policy_version: int
    next_training_step: int
    max_steps_off_policy: int
    max_batch_size: int
    #: Usable groups the trainer holds for the batch it is collecting (0 while training).
    collected: int
    #: Groups waiting in the channel between the rollout workers and the trainer.
    queued: int
    #: Admitted rollouts not yet delivered whose groups can still be trained.
    fresh_in_flight: int

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
        batches_left = self.max_steps_off_policy + (0 if self.training else 1)
        return batches_left * self.max_batch_size - self.collected


def reference_gate_allows(s: GateSnapshot) -> bool:
    """The reference's gate: `policy_version >= next_training_step - max_steps_off_policy`."""
    return s.policy_version >= s.next_training_step - s.max_steps_off_policy


def staleness_aware_allows(s: GateSnapshot, beyond_bound: int) -> bool:
    """Admit only rollouts that the remaining window can still train, plus `beyond_bound`.

    Every fresh rollout in flight and every group queued will take one of the window's slots
    before a rollout started now does, so a new rollout is useful only while they leave one
    free. `beyond_bound` extra rollouts buy trainer utilization (the slowest rollouts of a
    batch no longer keep the trainer waiting) at the price of some stale ones.
    """
    if not reference_gate_allows(s):
        return False
    return s.fresh_in_flight + s.queued < s.window_slots + beyond_bound


def admission_allows(s: GateSnapshot, admission: Admission, beyond_bound: int) -> bool:
    """The admission decision for a configured mode (see `PipelineSettings.admission`)."""
    if admission == "eager":
        return reference_gate_allows(s)
    return staleness_aware_allows(s, beyond_bound)


class _Waiter:
    __slots__ = ("event", "version")

    def __init__(self) -> None:
        self.event = anyio.Event()
        #: The version whose slot `_pump` took for this waiter; None until admitted.
        self.version: int | None = None


class GateClosed(Exception):
    """Raised by `PolicyGate.admit` once the run stops admitting rollouts."""


class PolicyGate:
    """Holds policy versions and the pipeline's occupancy; admits rollouts in FIFO order.

    Waiting workers queue up and are woken one at a time as admission frees up, so a policy
    update wakes exactly the workers that may start instead of every worker at once.
    """

    def __init__(
        self,
        *,
        start_step: int,
        max_steps_off_policy: int,
        max_batch_size: int,
        admission: Admission = "staleness_aware",
        beyond_bound: int = 0,
    ) -> None:
        self.policy_version = start_step
        self.next_training_step = start_step
        self.max_steps_off_policy = max_steps_off_policy
        self.max_batch_size = max_batch_size
        self.admission: Admission = admission
        self.beyond_bound = beyond_bound
        self.collected = 0
        self.queued = 0
        self._in_flight: Counter[int] = Counter()
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        self._version_published = anyio.Event()

    # -- decisions -----------------------------------------------------------------------

    def snapshot(self) -> GateSnapshot:
        floor = self.next_training_step - self.max_steps_off_policy
        return GateSnapshot(
            policy_version=self.policy_version,
            next_training_step=self.next_training_step,
            max_steps_off_policy=self.max_steps_off_policy,
            max_batch_size=self.max_batch_size,
            collected=self.collected,
            queued=self.queued,
            fresh_in_flight=sum(n for v, n in self._in_flight.items() if v >= floor),
        )

    @property
    def min_fresh_version(self) -> int:
        """Groups older than this can no longer be trained by any batch not yet taken."""
        return self.next_training_step - self.max_steps_off_policy

    def batch_min_version(self, current_step: int) -> int:
        """Oldest version the batch that produces `current_step + 1` accepts."""
        return current_step - self.max_steps_off_policy

    def may_start(self) -> bool:
        return not self._closed and admission_allows(
            self.snapshot(), self.admission, self.beyond_bound
        )

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the rollout side ----------------------------------------------------------------

    async def admit(self) -> int:
        """Wait until a rollout may start; return the policy version it starts at.

        The caller then owns one in-flight slot and must give it back with `rollout_done`.
        Raises GateClosed once the run stops admitting.
        """
        if self._closed:
            raise GateClosed
        if not self._waiters and self.may_start():
            await anyio.lowlevel.checkpoint()
            if self._closed:
                raise GateClosed
            if not self._waiters and self.may_start():
                return self._take_slot()
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.version is not None:
                # Admitted and cancelled in the same breath: hand the slot back.
                self.rollout_done(waiter.version)
            else:
                self._discard_waiter(waiter)
            raise
        if waiter.version is None:
            raise GateClosed
        return waiter.version

    def rollout_done(self, version: int) -> None:
        """A rollout admitted at `version` ended without handing a group over."""
        self._in_flight[version] -= 1
        self._drop_empty()
        self._pump()

    def hand_over(self, version: int) -> None:
        """A rollout admitted at `version` is handing its group to the channel."""
        self._in_flight[version] -= 1
        self._drop_empty()
        self.queued += 1

    def withdraw(self) -> None:
        """A hand-over was cancelled before the group entered the channel."""
        self.queued -= 1
        self._pump()

    # -- the training side ---------------------------------------------------------------

    def group_received(self, *, usable: bool) -> None:
        """The trainer took a group out of the channel; `usable` if it joins the batch."""
        self.queued -= 1
        if usable:
            self.collected += 1
        self._pump()

    def begin_training(self, step: int) -> None:
        """The collected batch goes to `backend.train` to produce `step`."""
        self.next_training_step = step
        self.collected = 0
        self._pump()

    def publish(self, version: int) -> None:
        """Weights for `version` are in place: rollouts may sample them from now on."""
        self.policy_version = version
        self.next_training_step = version
        self.collected = 0
        previous, self._version_published = self._version_published, anyio.Event()
        previous.set()
        self._pump()

    async def wait_for_version_after(self, version: int) -> None:
        """Return once a version newer than `version` is published (or the gate closes)."""
        while self.policy_version <= version and not self._closed:
            await self._version_published.wait()

    def close(self) -> None:
        """Stop admitting: every waiting and future `admit` raises GateClosed."""
        if self._closed:
            return
        self._closed = True
        while self._waiters:
            self._waiters.popleft().event.set()
        self._version_published.set()

    # -- internals -----------------------------------------------------------------------

    def _take_slot(self) -> int:
        self._in_flight[self.policy_version] += 1
        return self.policy_version

    def _pump(self) -> None:
        while self._waiters and self.may_start():
            waiter = self._waiters.popleft()
            waiter.version = self._take_slot()
            waiter.event.set()

    def _discard_waiter(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _drop_empty(self) -> None:
        for version in [v for v, n in self._in_flight.items() if n <= 0]:
            del self._in_flight[version]


__all__ = [
    "GateClosed",
    "GateSnapshot",
    "PolicyGate",
    "admission_allows",
    "reference_gate_allows",
    "staleness_aware_allows",
]
